"""The proposer registry: a name maps to a class implementing the protocol in base.py.

Dispatch happens once, in `build_proposer`; the engine only ever calls the protocol's methods.
"""
from __future__ import annotations

from ..decoding.protocol import Outcome, Proposal, Proposer
from ..errors import SpecdecError
from .block import BlockProposer
from .draft_model import DraftModelProposer
from .eagle import EagleProposer
from .mtp import MTPProposer
from .ngram import NgramProposer
from .parallel import ParallelDraftProposer
from .self_draft import SelfDraftProposer
from .suffix import SuffixProposer

PROPOSERS = {cls.name: cls for cls in (DraftModelProposer, NgramProposer, MTPProposer, SuffixProposer,
                                       EagleProposer, ParallelDraftProposer, BlockProposer, SelfDraftProposer)}


def build_proposer(name: str, **kwargs) -> Proposer:
    """build_proposer("draft-model", model=...), build_proposer("ngram", max_n=3, min_n=1) or
    build_proposer("mtp", heads=heads.load_heads(...), target=...) or
    build_proposer("eagle", head=eagle.load_eagle(...), target=...) or
    build_proposer("block", head=block.load_block(...), target=...)."""
    if name not in PROPOSERS:
        raise SpecdecError(f"unknown proposer {name!r}; known: {', '.join(sorted(PROPOSERS))}")
    return PROPOSERS[name](**kwargs)


__all__ = ["PROPOSERS", "Outcome", "Proposal", "Proposer", "build_proposer"]
