"""A controlled-error speculator for tests and benchmarks: drafts from known continuations
with chosen errors.

`ScriptedProposer(sequences, accept_lengths, n_candidates)` knows each request's full greedy
sequence (prompt + output, from a run without speculation). At its s-th proposal for a request,
the best of `n_candidates` paths agrees with the truth for exactly `accept_lengths[s % len]`
drafts (capped by the depth) and is wrong after that; the other paths go wrong earlier, at
varied depths, so the tree has real branches and the best path is not always candidate 0. The
number of drafts the engine accepts is then known in advance: `expected[request_id]` lists it
per proposal.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.spec_decode.proposer import ProposalInput
from engine.spec_decode.tree import DraftTree


class ScriptedProposer:
    def __init__(
        self,
        sequences: Sequence[Sequence[int]],
        accept_lengths: Sequence[int],
        num_heads: int,
        n_candidates: int = 1,
        vocab_size: int = 49152,
    ) -> None:
        self.sequences = [list(s) for s in sequences]
        self.accept_lengths = list(accept_lengths)
        self._num_heads = num_heads
        self.n_candidates = n_candidates
        self.vocab_size = vocab_size
        self.expected: dict[str, list[int]] = {}

    @property
    def num_heads(self) -> int:
        return self._num_heads

    @property
    def num_candidates(self) -> int:
        return self.n_candidates

    def propose(
        self, inputs: Sequence[ProposalInput], max_candidates: int | None = None
    ) -> list[DraftTree]:
        """Every tree whole: `max_candidates` only allows leaving candidates out."""
        return [self._tree(p) for p in inputs]

    def _truth(self, token_ids: Sequence[int], depth: int) -> list[int] | None:
        known = list(token_ids)
        for seq in self.sequences:
            if seq[: len(known)] == known and len(seq) > len(known):
                return seq[len(known) : len(known) + depth]
        return None

    def _wrong(self, token: int, k: int) -> int:
        return (token + 1 + k) % self.vocab_size

    def _tree(self, p: ProposalInput) -> DraftTree:
        expected = self.expected.setdefault(p.request_id, [])
        truth = self._truth(p.token_ids, p.max_depth)
        if truth is None:  # past the known sequence: anything, all wrong or right by chance
            expected.append(-1)
            return DraftTree.chain([0] * p.max_depth)
        depth = p.max_depth
        step = len(expected)
        best = min(self.accept_lengths[step % len(self.accept_lengths)], depth, len(truth))
        truth = truth + [0] * (depth - len(truth))
        paths = []
        for c in range(self.n_candidates):
            # Candidate c is right for `best - c` drafts (the best one is the last candidate
            # when `step` is odd), then wrong with a token of its own.
            correct = max(best - c, 0)
            path = truth[:correct]
            if correct < depth:
                path.append(self._wrong(truth[correct], c))
            path += [self._wrong(t, c + 7) for t in truth[len(path) : depth]]
            paths.append(path)
        if step % 2:
            paths.reverse()
        expected.append(best)
        return DraftTree.from_paths(paths)
