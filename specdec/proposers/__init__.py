"""The proposers: each source of draft tokens implements the protocol in decoding/protocol.py;
drafters.py is their registry (a name maps to how it is built from a folder, with its options);
from networks in hand, a proposer's class makes it.
"""
from __future__ import annotations

from ..decoding.protocol import Outcome, Proposal, Proposer
from .block import BlockProposer
from .draft_model import DraftModelProposer
from .drafters import (DRAFTERS, DraftModelOptions, NgramOptions, NoOptions, TreeOptions, VocabOptions,
                       build_drafter)
from .eagle import EagleProposer
from .guided_ngram import GuidedNgramProposer
from .hybrid import HybridProposer
from .mtp import MTPProposer
from .ngram import NgramProposer
from .parallel import ParallelDraftProposer
from .self_draft import SelfDraftProposer
from .suffix import SuffixProposer

__all__ = ["DRAFTERS", "BlockProposer", "DraftModelOptions", "DraftModelProposer", "EagleProposer",
           "GuidedNgramProposer", "HybridProposer", "MTPProposer", "NgramOptions", "NgramProposer", "NoOptions",
           "Outcome", "ParallelDraftProposer", "Proposal", "Proposer", "SelfDraftProposer", "SuffixProposer",
           "TreeOptions", "VocabOptions", "build_drafter"]
