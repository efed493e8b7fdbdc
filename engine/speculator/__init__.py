"""Speculative decoding: the MLP speculator, its loader, draft trees and proposers."""

from engine.speculator.mlp_speculator import MLPSpeculator, MLPSpeculatorConfig
from engine.speculator.proposer import MLPProposer, ProposalInput, Proposer
from engine.speculator.tree import DraftTree

__all__ = [
    "DraftTree",
    "MLPProposer",
    "MLPSpeculator",
    "MLPSpeculatorConfig",
    "ProposalInput",
    "Proposer",
]
