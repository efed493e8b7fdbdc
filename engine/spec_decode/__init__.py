"""Speculative decoding: the MLP speculator and its loader, proposers, draft trees, the policy
that decides when drafting pays, and the verifier that walks each tree."""
