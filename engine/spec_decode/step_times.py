"""Step times as the speculation policy keeps them: per row count the fastest of the recent
measurements (`StepTimes`), and the piecewise-linear curve through them (`Curve`)."""

from __future__ import annotations

import bisect
from collections import deque


class Fastest:
    """The least of the last `window` samples (a busy host only ever adds time), and when (a
    decision count) the last came."""

    def __init__(self, window: int) -> None:
        self.samples: deque[float] = deque(maxlen=window)
        self.value = 0.0
        self.last = 0

    def add(self, x: float, when: int) -> None:
        self.samples.append(x)
        self.value = min(self.samples)
        self.last = when

    @property
    def count(self) -> int:
        return len(self.samples)


class StepTimes:
    """Step seconds by row count, each the fastest of its recent samples, and the curve through
    them, rebuilt only after one of them changed: a busy engine records a step time every step,
    and most leave every fastest as it was."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.by_rows: dict[int, Fastest] = {}
        self.version = 0  # counts the changes of the curve
        self._curve: Curve | None = None

    def add(self, num_rows: int, seconds: float, when: int) -> None:
        fastest = self.by_rows.get(num_rows)
        if fastest is None:
            fastest = self.by_rows[num_rows] = Fastest(self.window)
        before = fastest.value if fastest.count else None
        fastest.add(seconds, when)
        if fastest.value != before:
            self.version += 1
            self._curve = None

    def curve(self) -> Curve:
        if self._curve is None:
            self._curve = Curve({r: m.value for r, m in self.by_rows.items()})
        return self._curve


class Curve:
    """The piecewise-linear curve through `points` (row count -> value); below the first point,
    the first value; above the last, the last value when `level_outside`, else extrapolated
    along the last two points (in proportion to x from one point)."""

    def __init__(self, points: dict[int, float], level_outside: bool = False) -> None:
        self.xs = sorted(points)
        self.points = points
        self.level_outside = level_outside

    def __call__(self, x: int) -> float | None:
        return self.at(x) if self.xs else None

    def at(self, x: int) -> float:
        """The value at `x`; needs at least one point."""
        points, xs = self.points, self.xs
        if x in points:
            return points[x]
        i = bisect.bisect_left(xs, x)
        if i == 0:
            return points[xs[0]]
        if i == len(xs):
            top = xs[-1]
            if self.level_outside:
                return points[top]
            if len(xs) == 1:
                return points[top] * x / top
            below = xs[-2]
            slope = (points[top] - points[below]) / (top - below)
            return points[top] + max(slope, 0.0) * (x - top)
        lo, hi = xs[i - 1], xs[i]
        return points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)
