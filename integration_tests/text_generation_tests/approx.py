"""Response comparison in the manner of TGIS's integration tests: exact structure, floats
approximately."""

from __future__ import annotations

import math
from typing import Any

REL_TOL = 5e-4
ABS_TOL = 1e-3
"""Logprobs near 0 come from fp32 logits that may differ by ~1e-3 between kernels."""


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def mismatches(actual: Any, expected: Any, path: str = "$") -> list[str]:
    """Every difference between two `MessageToDict` values, as readable lines (none: equal).

    Dicts must have the same keys, except that a float field absent on one side counts as 0.0
    (MessageToDict omits zero values, e.g. a logprob of 0). Lists must have the same length.
    Floats match within REL_TOL relative or ABS_TOL absolute; "NaN" matches only "NaN".
    """
    if isinstance(expected, dict) and isinstance(actual, dict):
        out = []
        for key in sorted(set(actual) | set(expected)):
            sub = f"{path}.{key}"
            if key in actual and key in expected:
                out += mismatches(actual[key], expected[key], sub)
                continue
            value = actual.get(key, expected.get(key))
            if not (isinstance(value, float) and math.isclose(value, 0.0, abs_tol=ABS_TOL)):
                side = "unexpected" if key in actual else "missing"
                out.append(f"{sub}: {side} ({value!r})")
        return out
    if isinstance(expected, list) and isinstance(actual, list):
        if len(actual) != len(expected):
            return [f"{path}: {len(actual)} items, expected {len(expected)}: {actual!r}"]
        return [
            m
            for i, (a, e) in enumerate(zip(actual, expected, strict=True))
            for m in mismatches(a, e, f"{path}[{i}]")
        ]
    if isinstance(actual, bool) != isinstance(expected, bool):
        return [f"{path}: {actual!r} != {expected!r}"]
    if (
        _is_number(actual)
        and _is_number(expected)
        and (isinstance(actual, float) or isinstance(expected, float))
    ):
        if math.isclose(actual, expected, rel_tol=REL_TOL, abs_tol=ABS_TOL):
            return []
        return [f"{path}: {actual!r} != {expected!r}"]
    return [] if actual == expected else [f"{path}: {actual!r} != {expected!r}"]


def assert_matches(actual: Any, expected: Any, what: str = "response") -> None:
    """Fail with every difference listed."""
    diffs = mismatches(actual, expected)
    assert not diffs, f"{what} differs from the expected one:\n  " + "\n  ".join(diffs)
