"""Speculative decoding: proposers that draft tokens and the rejection sampler that verifies them."""

from kilat.spec_decode.proposer import Proposer, build_proposer, num_draft_slots

__all__ = ["Proposer", "build_proposer", "num_draft_slots"]
