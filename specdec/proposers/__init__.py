"""The proposers: each source of draft tokens implements the protocol in decoding/protocol.py;
drafters.py is their registry (a name maps to how it is built, from a folder or from networks).
"""
from __future__ import annotations

from ..decoding.protocol import Outcome, Proposal, Proposer
from .drafters import (
    DRAFTERS,
    PROPOSERS,
    DraftModelOptions,
    NgramOptions,
    NoOptions,
    VocabOptions,
    build_drafter,
    build_proposer,
)

__all__ = ["DRAFTERS", "PROPOSERS", "DraftModelOptions", "NgramOptions", "NoOptions", "Outcome", "Proposal", "Proposer",
           "VocabOptions", "build_drafter", "build_proposer"]
