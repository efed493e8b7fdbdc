"""When speculation pays, and with how many candidates, from costs measured while serving.

Before each step the engine asks `choose(num_plain_rows, num_spec_requests)` for the number k of
candidate paths each speculating request verifies (0: none, decode normally). The choice
maximises the step's expected tokens per second,

    (num_plain_rows + num_spec_requests * T_k) / time(num_plain_rows + num_spec_requests * S_k)

with T_k the mean tokens a request gains with its first k candidates (accepted drafts + 1;
T_0 = 1), S_k the mean rows their tree takes (S_0 = 1) and time(rows) the measured time of a
step of that many rows: of plain steps for k = 0, of speculative steps (drafting included) for
k > 0, kept apart because a tree's rows cost more than as many prompt rows. Every verified tree of K
candidates also tells what each k <= K would have accepted (`DraftTree.match_lengths`), so one
full-tree step updates every T_k. Before any speculative step is timed, the tree is tried;
every `refresh_every` speculative steps the full tree is verified again so that T_k stays
current, and after `explore_every` plain decisions in a row it is tried again, so that one
unlucky early measurement (a cold first step, drafts that missed) cannot turn speculation off for
good. Such tries only measure: `probing` tells the engine to draft for one request, so a probe
costs one tree's rows, whatever the batch.
"""

from __future__ import annotations

import bisect

from engine.speculator.tree import DraftTree


class _Mean:
    """An exponential moving average (a plain mean for the first 1/alpha samples)."""

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.count = 0
        self.value = 0.0

    def add(self, x: float) -> None:
        self.count += 1
        self.value += (x - self.value) * max(self.alpha, 1 / self.count)


class SpeculationPolicy:
    def __init__(
        self,
        num_candidates: int,
        refresh_every: int = 16,
        alpha: float = 0.05,
        explore_every: int = 100,
    ) -> None:
        if num_candidates < 1:
            raise ValueError(f"num_candidates must be positive, got {num_candidates}")
        self.num_candidates = num_candidates
        self.refresh_every = refresh_every
        self.explore_every = explore_every
        self.alpha = alpha
        self.tokens = [_Mean(alpha) for _ in range(num_candidates + 1)]  # T_k
        self.rows = [_Mean(alpha) for _ in range(num_candidates + 1)]  # S_k
        self._step_seconds: tuple[dict[int, _Mean], dict[int, _Mean]] = ({}, {})  # plain, spec
        self._since_full = 0
        self._since_speculative = 0  # plain decisions in a row
        self.probing = False  # the last choice only measures: speculate for one request

    def choose(self, num_plain_rows: int, num_spec_requests: int) -> int:
        """How many candidates each of `num_spec_requests` requests verifies next step."""
        self.probing = False
        if num_spec_requests == 0:
            return 0
        full = self.num_candidates
        if self.tokens[full].count == 0 or self._since_speculative >= self.explore_every:
            self.probing = True
            return self._chosen(full)
        if self._since_full >= self.refresh_every:
            return self._chosen(full)
        best_k, best_rate = 0, 0.0
        for k in range(full + 1):
            if k and self.tokens[k].count == 0:
                continue
            tokens = num_plain_rows + num_spec_requests * (self.tokens[k].value if k else 1.0)
            rows = num_plain_rows + num_spec_requests * (self.rows[k].value if k else 1.0)
            seconds = self.predict_seconds(round(rows), speculative=k > 0)
            if seconds is None:  # no speculative step timed yet: try one
                self.probing = True
                return self._chosen(k)
            if tokens / seconds > best_rate:
                best_k, best_rate = k, tokens / seconds
        return self._chosen(best_k)

    def _chosen(self, k: int) -> int:
        self._since_full = 0 if k == self.num_candidates else self._since_full + (k > 0)
        self._since_speculative = 0 if k else self._since_speculative + 1
        return k

    def observe_tree(self, tree: DraftTree, token_ids: list[int]) -> None:
        """A verified tree and the tokens its request gained from it."""
        matches = tree.match_lengths(token_ids)
        best = 0
        for k in range(1, len(matches) + 1):
            best = max(best, matches[k - 1])
            self.tokens[k].add(best + 1)
            self.rows[k].add(max(tree.leaves[:k]) + 1)

    def observe_step(self, num_rows: int, seconds: float, speculative: bool = False) -> None:
        """A step that fed `num_rows` tokens to the model took `seconds`; `speculative` when it
        verified draft trees (its drafting included in `seconds`)."""
        table = self._step_seconds[speculative]
        table.setdefault(num_rows, _Mean(self.alpha)).add(seconds)

    def predict_seconds(self, num_rows: int, speculative: bool = False) -> float | None:
        """The time of a plain (or `speculative`) step of `num_rows` rows: measured, or
        interpolated between the nearest measured row counts, or extrapolated along the last
        two (in proportion to the rows from one); None before any step of that kind."""
        table = self._step_seconds[speculative]
        if num_rows in table:
            return table[num_rows].value
        known = sorted(table)
        if not known:
            return None
        i = bisect.bisect_left(known, num_rows)
        if i == len(known):
            top = known[-1]
            if len(known) == 1:
                return table[top].value * num_rows / top
            below = known[-2]
            slope = (table[top].value - table[below].value) / (top - below)
            return table[top].value + max(slope, 0.0) * (num_rows - top)
        hi = known[i]
        if i == 0:
            return table[hi].value
        lo = known[i - 1]
        t_lo, t_hi = table[lo].value, table[hi].value
        return t_lo + (t_hi - t_lo) * (num_rows - lo) / (hi - lo)
