"""When speculation pays, and with how many candidates, from costs measured while serving.

Before each step the engine asks `choose(num_plain_rows, num_spec_requests)` for the number k of
candidate paths the speculating requests of each decoding method (greedy, sampled) verify (0:
none, decode normally). The choice maximises the step's expected tokens per second,

    (num_plain_rows + sum_m n_m * T_m,k_m) / time(num_plain_rows + sum_m n_m * S_m,k_m rows,
                                                  the number of requests with k_m > 0 trees)

with n_m the requests of method m, T_m,k the mean tokens a request of method m gains with its
first k candidates (accepted drafts + 1; T_m,0 = 1) and S_m,k the mean rows their tree takes
(S_m,0 = 1). Each method has its own acceptance: a sampled token matches a draft less often than
a greedy one, so sampled trees are priced by what sampled requests accepted. Step times are
measured: plain steps by their rows; speculative steps (drafting included) by their rows and
their number of trees, since a tree's rows cost more than as many prompt rows and every tree
adds its own drafting and bookkeeping, so one request's 16-row tree says little about four
requests' 4-row trees. A step time is the least of its last `window` measurements: other work
on the host only ever adds time, so slow steps (a cold start, a busy neighbour) do not steer
the choice. Every verified tree of K candidates also tells what each k <= K would have accepted
(`DraftTree.match_lengths`), so one full-tree step updates every T_k.

What the choice rests on is kept current: speculation waits until the plain step it must beat
has been timed `min_samples` times, the last within `2 * refresh_every` decisions (else the step
decodes plainly, and so times it), so that a host that sped up or slowed down since cannot make
a stale plain time look dear or cheap; every `refresh_every` speculative steps one request
verifies the full tree (`refreshing` names its method; the others keep the choice) so that T_k
stays current for every k, but only once the steps since the last full tree took what it adds
to a step over `refresh_budget`, so that refreshes cost at most that share of the time (a
single client's full tree can take longer than the rest of its step); after `explore_every`
plain decisions in a row the tree is tried again, so that one unlucky measurement (drafts that
missed) cannot turn speculation off for good. Such tries only measure: `probing` tells the
engine to draft for one request. So a probe or a refresh costs one tree's rows, whatever the
batch. A try that the policy does not follow by speculating doubles the wait for the next one,
up to `max_explore_every` decisions (where speculation does not pay, as with a large batch,
tries cost little), and the policy's own choice to speculate brings it back to
`explore_every`. A number of trees never timed is priced between the nearest fewer and more
trees timed, or as the nearest outside them; the step that follows measures it.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Mapping
from enum import StrEnum

from engine.sampling.params import SamplingParams
from engine.spec_decode.step_times import Curve, StepTimes
from engine.spec_decode.tree import DraftTree


class Method(StrEnum):
    """How a request chooses its tokens; each method has its own acceptance."""

    GREEDY = "greedy"
    SAMPLE = "sample"

    @staticmethod
    def of(params: SamplingParams) -> Method:
        return Method.GREEDY if params.greedy else Method.SAMPLE


class _Mean:
    """An exponential moving average (a plain mean for the first 1/alpha samples)."""

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.count = 0
        self.value = 0.0

    def add(self, x: float) -> None:
        self.count += 1
        self.value += (x - self.value) * max(self.alpha, 1 / self.count)


class Acceptance:
    """What verified trees of one method gave: `tokens[k]` (T_k), the mean tokens a request
    gained with its first k candidates, and `rows[k]` (S_k), the mean rows those took."""

    def __init__(self, num_candidates: int, alpha: float) -> None:
        self.tokens = [_Mean(alpha) for _ in range(num_candidates + 1)]
        self.rows = [_Mean(alpha) for _ in range(num_candidates + 1)]

    def observe(self, tree: DraftTree, token_ids: list[int]) -> None:
        """A verified tree and the tokens its request gained from it: every k up to the tree's
        candidates learns what its first k candidates would have accepted."""
        matches = tree.match_lengths(token_ids)
        best = 0
        for k in range(1, len(matches) + 1):
            best = max(best, matches[k - 1])
            self.tokens[k].add(best + 1)
            self.rows[k].add(max(tree.leaves[:k]) + 1)

    def tokens_and_rows(self, k: int) -> tuple[float, float]:
        """(T_k, S_k); (1, 1) for k = 0."""
        return (self.tokens[k].value, self.rows[k].value) if k else (1.0, 1.0)


class SpeculationPolicy:
    def __init__(
        self,
        num_candidates: int,
        refresh_every: int = 16,
        refresh_budget: float = 0.02,
        alpha: float = 0.05,
        explore_every: int = 100,
        max_explore_every: int = 800,
        window: int = 8,
        min_samples: int = 3,
    ) -> None:
        if num_candidates < 1:
            raise ValueError(f"num_candidates must be positive, got {num_candidates}")
        if not 0 < explore_every <= max_explore_every:
            raise ValueError(
                f"need 0 < explore_every ({explore_every}) <= max_explore_every "
                f"({max_explore_every})"
            )
        self.num_candidates = num_candidates
        self.refresh_every = refresh_every
        self.refresh_budget = refresh_budget
        self.explore_every = explore_every
        self.max_explore_every = max_explore_every
        self._explore_wait = explore_every  # plain decisions in a row before the next try
        self.alpha = alpha
        self.window = window
        self.min_samples = min_samples
        self.acceptance = {m: Acceptance(num_candidates, alpha) for m in Method}
        self._plain_seconds = StepTimes(window)
        self._spec_seconds: dict[int, StepTimes] = {}  # number of trees -> their step times
        # number of trees -> ((plain version, spec version), the excess curve of those versions)
        self._excess: dict[int, tuple[tuple[int, int], Curve]] = {}
        self._num_decisions = 0
        self._since_full = dict.fromkeys(Method, 0)  # speculative decisions since a full tree
        self._elapsed = 0.0  # seconds of the steps observed
        self._full_at = dict.fromkeys(Method, 0.0)  # `_elapsed` at each method's last full tree
        self._since_speculative = 0  # plain decisions in a row
        self.probing = False  # the last choice only measures: speculate for one request
        self.refreshing: set[Method] = set()  # the last choice's methods that refresh T_k

    def choose(
        self, num_plain_rows: int, num_spec_requests: Mapping[Method, int]
    ) -> dict[Method, int]:
        """How many candidates each of the `num_spec_requests[m]` requests of method m verifies
        next step, in a step that also computes `num_plain_rows` rows for other requests; a
        method left out decodes plainly."""
        self.probing = False
        self.refreshing = set()
        counts = {m: n for m, n in num_spec_requests.items() if n > 0}
        if not counts:
            return {}
        self._num_decisions += 1
        full = self.num_candidates
        if not self._plain_time_is_current(num_plain_rows + sum(counts.values())):
            return self._chosen({})
        unmeasured = [m for m in counts if self.acceptance[m].tokens[full].count == 0]
        if unmeasured or self._since_speculative >= self._explore_wait:
            self.probing = True
            if not unmeasured:
                self._explore_wait = min(2 * self._explore_wait, self.max_explore_every)
            return self._chosen({(unmeasured or list(counts))[0]: full})
        plain_time = self._plain_time()
        # Per method, its options (k, tokens, rows, trees): what its n requests gain and take.
        options = []
        for m, n in counts.items():
            acceptance = self.acceptance[m]
            options.append(
                [
                    (k, n * t, n * r, n if k else 0)
                    for k in range(full + 1)
                    if k == 0 or acceptance.tokens[k].count
                    for t, r in (acceptance.tokens_and_rows(k),)
                ]
            )
        best = tuple(method_options[0] for method_options in options)  # k = 0: decode plainly
        time_by_trees: dict[int, Callable[[int], float | None]] = {0: plain_time}
        best_rate, best_rows, best_time = 0.0, 0.0, time_by_trees[0]
        for combo in itertools.product(*options):
            tokens = rows = float(num_plain_rows)
            num_trees = 0
            for _, t, r, trees in combo:
                tokens, rows, num_trees = tokens + t, rows + r, num_trees + trees
            if num_trees not in time_by_trees:
                time_by_trees[num_trees] = self._spec_time(plain_time, num_trees)
            step_time = time_by_trees[num_trees]
            seconds = step_time(round(rows))
            if seconds is None:  # no speculative step timed yet: try one
                self.probing = True
                return self._chosen({m: o[0] for m, o in zip(counts, combo, strict=True) if o[0]})
            if tokens / seconds > best_rate:
                best, best_rate, best_rows, best_time = combo, tokens / seconds, rows, step_time

        def refresh_cost(m: Method, k: int) -> float:
            """What one request of method m verifying the full tree instead of k candidates
            adds to the chosen step."""
            extra = self.acceptance[m].rows[full].value - self.acceptance[m].rows[k].value
            before, after = best_time(round(best_rows)), best_time(round(best_rows + extra))
            return max((after or 0.0) - (before or 0.0), 0.0)

        choice = {m: option[0] for m, option in zip(counts, best, strict=True) if option[0]}
        return self._chosen(choice, refresh_cost)

    def _chosen(
        self,
        choice: dict[Method, int],
        refresh_cost: Callable[[Method, int], float] | None = None,
    ) -> dict[Method, int]:
        """Record `choice`; a speculating method `refresh_every` decisions past its last full
        tree joins `refreshing` (one of its requests verifies the full tree this step) once the
        steps since then took `refresh_cost(m, k) / refresh_budget` seconds or more."""
        for m, k in choice.items():
            if (
                k < self.num_candidates
                and self._since_full[m] >= self.refresh_every
                and (
                    refresh_cost is None
                    or self._elapsed - self._full_at[m] >= refresh_cost(m, k) / self.refresh_budget
                )
            ):
                self.refreshing.add(m)
            if k == self.num_candidates or m in self.refreshing:
                self._since_full[m], self._full_at[m] = 0, self._elapsed
            else:
                self._since_full[m] += 1
        self._since_speculative = 0 if choice else self._since_speculative + 1
        if choice and not self.probing:
            self._explore_wait = self.explore_every
        return choice

    def observe_tree(self, tree: DraftTree, token_ids: list[int], method: Method) -> None:
        """A verified tree of a request of `method` and the tokens the request gained from it."""
        self.acceptance[method].observe(tree, token_ids)

    def observe_step(self, num_rows: int, seconds: float, num_trees: int = 0) -> None:
        """A step that fed `num_rows` tokens to the model took `seconds`; `num_trees` draft trees
        were verified in it (their drafting included in `seconds`)."""
        self._elapsed += seconds
        if num_trees == 0:
            table = self._plain_seconds
        else:
            table = self._spec_seconds.setdefault(num_trees, StepTimes(self.window))
        table.add(num_rows, seconds, self._num_decisions)

    def predict_seconds(self, num_rows: int, num_trees: int = 0) -> float | None:
        """The time of a step of `num_rows` rows that verifies `num_trees` draft trees (0: a plain
        step), None before any step of that kind.

        A plain step's time is measured, or interpolated between the nearest measured row
        counts, or extrapolated along the last two (in proportion to the rows from one). A
        speculative step costs a plain step of its rows plus an excess (drafting, tree
        attention, verification) that is interpolated in the same way between the row counts
        measured with that many trees but held level outside them; a number of trees never
        timed takes the excess interpolated between the nearest fewer and more trees timed
        (linearly in the number of trees), or outside them the excess of the nearest."""
        plain = self._plain_time()
        return (self._spec_time(plain, num_trees) if num_trees else plain)(num_rows)

    def _plain_time(self) -> Curve:
        return self._plain_seconds.curve()

    def _spec_time(self, plain: Curve, num_trees: int) -> Callable[[int], float | None]:
        """`predict_seconds` for `num_trees` > 0 trees, as a function of the rows, given the
        plain step time `plain` (the current `_plain_time()`)."""
        if not self._spec_seconds:
            return lambda num_rows: None
        timed = sorted(self._spec_seconds)
        i = bisect.bisect_left(timed, num_trees)
        if not plain.xs:
            nearest = min(timed, key=lambda n: (abs(n - num_trees), n))
            return self._spec_seconds[nearest].curve()
        if (i < len(timed) and timed[i] == num_trees) or i in (0, len(timed)):
            excess = self._excess_curve(plain, timed[min(i, len(timed) - 1)])
            return lambda num_rows: plain.at(num_rows) + excess.at(num_rows)
        fewer, more = timed[i - 1], timed[i]
        w = (num_trees - fewer) / (more - fewer)
        low, high = self._excess_curve(plain, fewer), self._excess_curve(plain, more)
        return lambda num_rows: (
            plain.at(num_rows) + (1 - w) * low.at(num_rows) + w * high.at(num_rows)
        )

    def _excess_curve(self, plain: Curve, num_trees: int) -> Curve:
        """What a step verifying `num_trees` (timed) trees took over a plain step of its rows,
        by rows, level outside the rows timed."""
        table = self._spec_seconds[num_trees]
        versions = (self._plain_seconds.version, table.version)
        cached = self._excess.get(num_trees)
        if cached is None or cached[0] != versions:
            spec = table.curve().points
            excess = Curve({r: t - plain.at(r) for r, t in spec.items()}, level_outside=True)
            cached = self._excess[num_trees] = (versions, excess)
        return cached[1]

    def _plain_time_is_current(self, num_rows: int) -> bool:
        """Whether the time of a plain `num_rows` step rests on `min_samples` measurements, of
        the row count itself or else of both its measured neighbours, each measured within the
        last `2 * refresh_every` decisions."""
        table = self._plain_seconds.by_rows
        if num_rows in table:
            used = [table[num_rows]]
        else:
            known = self._plain_seconds.curve().xs
            i = bisect.bisect_left(known, num_rows)
            used = [table[r] for r in known[max(i - 1, 0) : i + 1]]
        return bool(used) and all(
            m.count >= self.min_samples and self._num_decisions - m.last <= 2 * self.refresh_every
            for m in used
        )
