"""The sampler's passes over whole vocabulary rows on a CPU, in C (`cpu_kernels.c`, in the
library `engine.kernels.cpu` builds): rows divided by their temperatures (`divide_rows`), each
row's best `k` scores (`top_candidates`), float64 row sums (`row_sums_double`,
`plogp_sums_double`) and where rows reach a threshold (`columns_at_least`). Each returns None
where the kernels are not built or a tensor is not float32 on a CPU with contiguous rows; the
caller then uses ATen ops."""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from engine.kernels.cpu import bind, load_cpu_kernels

_P = ctypes.c_void_p
_I = ctypes.c_int64
_SIGNATURES: dict[str, tuple[list[Any], Any]] = {
    "divide_rows": ([_P, _I, _P, _I, _I, _P, _P], None),
    "top_candidates": ([_P, _I, _I, _I, _I, _P, _P, _P, _P], None),
    "row_sums_double": ([_P, _I, _I, _I, _P], None),
    "plogp_sums_double": ([_P, _P, _I, _I, _P, _P, _P], None),
    "columns_at_least": ([_P, _I, _I, _I, _P, _P, _P, _I], _I),
}


@functools.cache
def _library() -> ctypes.CDLL | None:
    kernels = load_cpu_kernels()
    if kernels is None:
        return None
    bind(kernels.lib, _SIGNATURES)
    return kernels.lib


def _usable(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The library, where every tensor is float32 on a CPU with contiguous rows."""
    if not all(x.device.type == "cpu" and x.dtype == torch.float32 and x.stride(-1) == 1
               for x in tensors):  # fmt: skip
        return None
    return _library()


def divide_rows(
    x: torch.Tensor, rows: torch.Tensor | None, divisors: torch.Tensor
) -> torch.Tensor | None:
    """x[rows] / divisors[:, None] (x [M, V], any row stride; rows [R] int64 each < M, or None
    for every row; divisors [R] float32) -> [R, V] contiguous, in one pass: each quotient
    IEEE float32 division's, as torch's. IndexError for a row outside [0, M)."""
    lib = _usable(x, divisors)
    if lib is None:
        return None
    n, v = (x.shape[0] if rows is None else rows.shape[0]), x.shape[1]
    if rows is not None:
        rows = rows.contiguous()
        if n and not (int(rows.min()) >= 0 and int(rows.max()) < x.shape[0]):
            raise IndexError(f"divide_rows: a row is outside [0, {x.shape[0]})")
    divisors = divisors.contiguous()
    out = torch.empty(n, v, dtype=torch.float32)
    lib.divide_rows(x.data_ptr(), x.stride(0), 0 if rows is None else rows.data_ptr(), n, v,
                    divisors.data_ptr(), out.data_ptr())  # fmt: skip
    return out


def top_candidates(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """scores [N, V] (any row stride), 1 <= k <= V -> the k best scores [N, k] of each row in
    descending order (ties: the lower column first) and their columns [N, k] int64."""
    lib = _usable(scores)
    if lib is None:
        return None
    n, v = scores.shape
    if not 1 <= k <= v:
        raise ValueError(f"k must be in [1, {v}], got {k}")
    values = torch.empty(n, k, dtype=torch.float32)
    ids = torch.empty(n, k, dtype=torch.int64)
    scratch, kept_ids = torch.empty(3 * v), torch.empty(v, dtype=torch.int64)
    lib.top_candidates(scores.data_ptr(), scores.stride(0), n, v, k, values.data_ptr(),
                       ids.data_ptr(), scratch.data_ptr(), kept_ids.data_ptr())  # fmt: skip
    return values, ids


def row_sums_double(x: torch.Tensor) -> torch.Tensor | None:
    """x [N, V] (any row stride) -> [N, 1] float64: each row's sum in float64, its terms added
    in an order of the kernel's own."""
    lib = _usable(x)
    if lib is None:
        return None
    n, v = x.shape
    sums = torch.empty(n, 1, dtype=torch.float64)
    lib.row_sums_double(x.data_ptr(), x.stride(0), n, v, sums.data_ptr())
    return sums


def plogp_sums_double(
    shifted: torch.Tensor, e: torch.Tensor, totals: torch.Tensor
) -> torch.Tensor | None:
    """[N, V] scores less their row maximum, [N, V] their `exp`, [N, 1] float32 sums of e ->
    [N, 1] float64: each row's sum of `torch.where(p > 0, p * logp, 0)`, p = e / totals,
    logp = shifted - totals.log(), each term the float32 torch computes, added in an order of
    the kernel's own."""
    lib = _usable(shifted, e, totals)
    if lib is None:
        return None
    n, v = shifted.shape
    shifted, e, totals = shifted.contiguous(), e.contiguous(), totals.contiguous()
    log_totals = totals.log()
    sums = torch.empty(n, 1, dtype=torch.float64)
    lib.plogp_sums_double(shifted.data_ptr(), e.data_ptr(), n, v, totals.data_ptr(),
                          log_totals.data_ptr(), sums.data_ptr())  # fmt: skip
    return sums


def columns_at_least(
    scores: torch.Tensor, thresholds: torch.Tensor, cap: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """scores [M, V] (any row stride), thresholds [M] float32 -> (rows, columns) [N] int64 of
    the entries at least their row's threshold, row-major (`nonzero`'s order); None when more
    than `cap` (or no kernels)."""
    lib = _usable(scores, thresholds)
    if lib is None:
        return None
    n, v = scores.shape
    thresholds = thresholds.contiguous()
    rows = torch.empty(cap, dtype=torch.int64)
    cols = torch.empty(cap, dtype=torch.int64)
    args = (scores.data_ptr(), scores.stride(0), n, v, thresholds.data_ptr(), rows.data_ptr())
    count = lib.columns_at_least(*args, cols.data_ptr(), cap)
    return None if count < 0 else (rows[:count], cols[:count])
