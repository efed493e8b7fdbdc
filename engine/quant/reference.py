"""The reference product of a `QuantizedWeight`: what every quantized kernel must compute.

With float activations (weight-only: W4A16 and W8A16 on CUDA) it is ``x @ W.T`` with W the
dequantized weight. With int8 activations (W8A8 and W4A8 on CPU, W8A8 on CUDA) each row of x,
its columns first gathered in the weight's stored order (``x[:, perm]``), is quantized in groups
of ``a = activation_group(in_features)`` consecutive columns (`quantize_rows`): one scale per
row and activation group, as llama.cpp's Q8_0 quantizes its activations in blocks of 32. The
product is summed exactly over blocks of ``b = gcd(a, group_size)`` columns, each inside one
activation group ``ga(j)`` and one weight group ``gw(j)``:

    y[m, o] = sum_j sx[m, ga(j)] * scales[o, gw(j)]
                    * (sum_{i in j} xq[m, i] * q[o, i] - zeros[o, gw(j)] * sum_{i in j} xq[m, i])

A kernel may sum the blocks in another order, so outputs agree to float32 rounding, not bit for
bit. Slow (float64, every block materialised): for tests and small layers only.
"""

from __future__ import annotations

import math

import torch

from engine.quant.weights import QuantizedWeight

ACTIVATION_GROUP = 64
"""The most input columns that share one activation scale."""


def activation_group(in_features: int) -> int:
    """Columns per activation group of a product with `in_features` inputs:
    gcd(ACTIVATION_GROUP, in_features), so that the groups tile the row (64 for every width that
    is a multiple of 64, 32 for 288, ...)."""
    return math.gcd(ACTIVATION_GROUP, in_features)


def quantize_rows(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32 [M, K] -> (xq int8 [M, K], sx float32 [M, K / group_size]): per row and group of
    `group_size` consecutive columns (dividing K), sx = max |x| / 127 and xq =
    round-half-to-even(x / sx) clamped to [-127, 127]; a group of zeros gets sx = 0, xq = 0.
    ``group_size=K``: one scale per row (how the int8 weights are quantized per output row)."""
    x = x.to(torch.float32)
    m, k = x.shape
    if group_size <= 0 or k % group_size:
        raise ValueError(f"quantize_rows: group_size {group_size} does not divide {k} columns")
    xg = x.reshape(m, k // group_size, group_size)
    sx = xg.abs().amax(dim=2) / 127.0
    safe = torch.where(sx > 0, sx, torch.ones_like(sx))
    xq = torch.round(xg / safe[:, :, None]).clamp(-127, 127)
    xq = torch.where(sx[:, :, None] > 0, xq, torch.zeros_like(xq))
    return xq.reshape(m, k).to(torch.int8), sx


def dequantize_rows(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """`quantize_rows` and back to float32: x's rows as the int8 kernels see them."""
    xq, sx = quantize_rows(x, group_size)
    m, k = xq.shape
    xg = xq.to(torch.float32).reshape(m, k // group_size, group_size) * sx[:, :, None]
    return xg.reshape(m, k)


def reference_linear(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,
    *,
    int8_activations: bool,
) -> torch.Tensor:
    """x [M, in] -> y [M, out] float32 (see the module docstring); `bias` [out] is added last."""
    x = x.to(torch.float32)
    if not int8_activations:
        y = x @ weight.dequantize(torch.float32).T
    else:
        xs = x if weight.perm is None else x[:, weight.perm]
        k, gs = weight.in_features, weight.group_size
        ga = activation_group(k)
        xq, sx = quantize_rows(xs, ga)
        bs = math.gcd(ga, gs)
        m, n_blocks = x.shape[0], k // bs
        xb = xq.to(torch.float64).reshape(m, n_blocks, bs)
        qb = weight.int_values().to(torch.float64).reshape(weight.out_features, n_blocks, bs)
        sums = torch.einsum("mbk,obk->mob", xb, qb)  # exact: integers far below 2**53
        w_group = torch.arange(n_blocks) * bs // gs
        if weight.zeros is not None:
            zeros = weight.zeros.to(torch.float64)[:, w_group]
            sums = sums - zeros[None] * xb.sum(dim=2)[:, None, :]
        scales = weight.scales.to(torch.float64)[:, w_group]  # [out, blocks]
        row_scales = sx.to(torch.float64)[:, torch.arange(n_blocks) * bs // ga]  # [M, blocks]
        y64 = (sums * scales[None] * row_scales[:, None, :]).sum(dim=2)
        y = y64.to(torch.float32)
    return y if bias is None else y + bias.to(torch.float32)
