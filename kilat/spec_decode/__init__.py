"""Speculative decoding: proposers that draft tokens and the rejection sampler that verifies them."""

from kilat.spec_decode.proposer import Proposer, TargetHiddenStates, build_proposer, num_draft_slots

__all__ = ["Proposer", "TargetHiddenStates", "build_proposer", "num_draft_slots"]
