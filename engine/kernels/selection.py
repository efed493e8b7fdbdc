"""The sampler's whole-vocabulary passes on a CPU in C (`cpu_kernels.c`): rows divided by
their temperatures (`divide_rows`), each row's best `k` scores (`top_candidates`) and float64
row sums (`row_sums_double`, `plogp_sums_double`); and where rows reach a threshold
(`columns_at_least`). Each returns None where the kernels are not
built or a tensor is not float32 on a CPU with contiguous rows; the caller then uses ATen ops."""

from __future__ import annotations

import torch

from engine.kernels.cpu import load_cpu_kernels


def _usable(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.stride(-1) == 1


def divide_rows(
    x: torch.Tensor, rows: torch.Tensor | None, divisors: torch.Tensor
) -> torch.Tensor | None:
    """x[rows] / divisors[:, None] ([M, V], rows [R] int64 or None for all, divisors [R]
    float32) -> [R, V]: the quotients torch's division gives, in one pass."""
    kernels = load_cpu_kernels()
    if kernels is None or not _usable(x) or divisors.dtype != torch.float32:
        return None
    return kernels.divide_rows(x, rows, divisors)


def top_candidates(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """[N, V] -> the k best scores [N, k] of each row in descending order (ties: the lower
    column first) and their columns [N, k] int64."""
    kernels = load_cpu_kernels()
    if kernels is None or not _usable(scores):
        return None
    return kernels.top_candidates(scores, k)


def row_sums_double(x: torch.Tensor) -> torch.Tensor | None:
    """[N, V] -> [N, 1] float64: each row's sum in float64, in an order of the kernel's own."""
    kernels = load_cpu_kernels()
    if kernels is None or not _usable(x):
        return None
    return kernels.row_sums_double(x)


def plogp_sums_double(
    shifted: torch.Tensor, e: torch.Tensor, totals: torch.Tensor
) -> torch.Tensor | None:
    """[N, V] scores less their row maximum, [N, V] their `exp`, [N, 1] float32 sums of e ->
    [N, 1] float64: each row's sum of `torch.where(p > 0, p * logp, 0)`, p = e / totals,
    logp = shifted - totals.log(), each term the float32 torch computes."""
    kernels = load_cpu_kernels()
    if kernels is None or not (_usable(shifted) and _usable(e)):
        return None
    return kernels.plogp_sums_double(shifted, e, totals)


def columns_at_least(
    scores: torch.Tensor, thresholds: torch.Tensor, cap: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """[M, V], [M] float32 -> (rows, columns) [N] int64 of the entries at least their row's
    threshold, row-major (`nonzero`'s order); None when more than `cap` (or no kernels)."""
    kernels = load_cpu_kernels()
    if kernels is None or not _usable(scores) or thresholds.dtype != torch.float32:
        return None
    return kernels.columns_at_least(scores, thresholds, cap)
