"""The reference product of a `QuantizedWeight`: what every quantized kernel must compute.

With float activations (weight-only: W4A16 and W8A16 on CUDA) it is ``x @ W.T`` with W the
dequantized weight. With int8 activations (W8A8 and W4A8 on CPU) each row of x is quantized
first, exactly as the CPU kernels do it (`quantize_rows`), and the integer group sums are exact:

    y[m, o] = sx[m] * sum_g scales[o, g] * (sum_{i in g} xq[m, i] * q[o, i]
                                            - zeros[o, g] * sum_{i in g} xq[m, i])

A kernel may sum the groups in another order, so outputs agree to float32 rounding, not bit
for bit. Slow (float64, every group materialised): for tests and small layers only.
"""

from __future__ import annotations

import torch

from engine.quant.weights import QuantizedWeight


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32 [M, K] -> (xq int8 [M, K], sx float32 [M]): per row, sx = max |x| / 127 and
    xq = round-half-to-even(x / sx) clamped to [-127, 127]; a row of zeros gets sx = 0, xq = 0."""
    x = x.to(torch.float32)
    sx = x.abs().amax(dim=1) / 127.0
    safe = torch.where(sx > 0, sx, torch.ones_like(sx))
    xq = torch.round(x / safe[:, None]).clamp(-127, 127)
    xq = torch.where(sx[:, None] > 0, xq, torch.zeros_like(xq))
    return xq.to(torch.int8), sx


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
        xq, sx = quantize_rows(xs)
        m, gs = x.shape[0], weight.group_size
        n_groups = weight.in_features // gs
        xg = xq.to(torch.float64).reshape(m, n_groups, gs)
        qg = weight.int_values().to(torch.float64).reshape(weight.out_features, n_groups, gs)
        sums = torch.einsum("mgk,ogk->mog", xg, qg)  # exact: integers far below 2**53
        if weight.zeros is not None:
            sums = sums - weight.zeros.to(torch.float64)[None] * xg.sum(dim=2)[:, None, :]
        y64 = (sums * weight.scales.to(torch.float64)[None]).sum(dim=2)
        y = (y64 * sx.to(torch.float64)[:, None]).to(torch.float32)
    return y if bias is None else y + bias.to(torch.float32)
