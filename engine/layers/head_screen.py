"""The argmax of a float32 LM head's logits for a few rows without reading the float weights.

A greedy row needs only the token of its largest logit. `HeadScreen` keeps an int8 copy of the
head (one scale per vocabulary row, `engine.quant.reference.quantize_rows`) and runs it through
the quantized rows kernel (int8 activations in groups, `engine.kernels.quant_rows`), which reads
a quarter of the float head's bytes. Each approximate logit a_j is within a bound of the exact
one, for row j of the head (w_j; w^_j as the int8 copy holds it) and an input x (x^ as the
kernel quantizes it, each entry of activation group g off by at most h_g, half its step):

    |x . w_j - a_j| <= sum_g h_g ||w^_j[g]||_1 + ||w_j - w^_j||_2 ||x||_2 + float32 rounding

(Hölder's inequality on w^_j . (x - x^), Cauchy-Schwarz on (w_j - w^_j) . x). Only the columns
whose upper bound reaches a lower bound of the maximum can hold it. Those few are narrowed
again by x . w^_j summed in float32 from their int8 rows, whose distance from x . w_j has no
activation term. The exact logits of the columns left are computed from the float weights, and
every other column is -inf (`head_screen` in `cpu_kernels.c`, after the int8 product). The
argmax of a row that `logits` returns is therefore the argmax of the exact logits, except where
two exact logits differ by float32 rounding alone (a near-tie a different float32 kernel may
also split). Columns the caller may mask (EOS before `min_new_tokens`) are passed as
`maskable_ids`: they are exact too, and the maximum is proven over the columns outside them, so
the argmax after masking any of them is exact as well.

The screen serves only callers that read nothing but each row's argmax (first index on ties),
and declines (None) where it cannot prove its answer: rows that are not finite, or more
candidate columns than `MAX_NEAR` or `MAX_CANDIDATES`. It holds its own copy of the weights,
made by `HeadScreen.build` and valid until the head's weights change (`weights_version`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Collection
from typing import Any

import torch

from engine.kernels.cpu import CpuKernels, bind
from engine.kernels.quant_rows import (
    PackedQuant,
    RowsQuantLinear,
    build_quant_kernel,
    kernel_isa,
)
from engine.layers.linear import Linear
from engine.quant.reference import activation_group, quantize_rows
from engine.quant.weights import QuantizedWeight

MAX_ROWS = 8
"""Most rows a screen takes: above, the int8 product and the narrowing of each row cost about
what the float head's product does."""
MAX_NEAR = 4096
"""Most columns a row may keep after the int8 product; with more, the float head answers."""
MAX_CANDIDATES = 256
"""Most candidate columns of a call, all its rows together; with more, the float head answers
(each candidate is read column by column from the float weights, so that many more would cost
about as much as the float head)."""
_P = ctypes.c_void_p
_I = ctypes.c_int64
_SIGNATURES: dict[str, tuple[list[Any], Any]] = {
    "head_screen": (
        [_P, _I, _I, _I, _P, _I, _P, _P, _P, _P, _P, _I, _P, _I, _I, _P, _P, _I, _P, _P, _P],
        _I,
    ),
}


class HeadScreen:
    """An int8 screen of a float32 CPU `Linear` head (see the module docstring)."""

    def __init__(
        self,
        head: Linear,
        kernels: CpuKernels,
        product: RowsQuantLinear,
        basis: torch.Tensor,  # [groups + 2, V] float32: see `build`
    ) -> None:
        assert isinstance(product.packed, PackedQuant)  # `build` makes sure of it
        self.head, self.product, self.basis = head, product, basis
        self.basis_max = basis.amax(dim=1).contiguous()  # [groups + 2]
        self.int8_rows, self.int8_scales = product.packed.packed, product.packed.scales
        self.version = head.weights_version
        self.group = activation_group(head.in_features)
        bind(kernels.lib, _SIGNATURES)
        self._run = kernels.lib.head_screen
        self._near = torch.empty(MAX_NEAR, dtype=torch.int64)  # the kernel's scratch
        self._refined = torch.empty(2 * MAX_NEAR, dtype=torch.float64)
        self._cols = torch.empty(MAX_CANDIDATES, dtype=torch.int64)
        self._acc = torch.empty(MAX_ROWS, MAX_CANDIDATES, dtype=torch.float32)
        self._no_ids = torch.empty(0, dtype=torch.int64)
        self.screened_rows = 0  # rows answered by the screen, for tests and benchmarks

    @classmethod
    def build(cls, head: Linear, kernels: CpuKernels | None) -> HeadScreen | None:
        """A screen of `head` (a float32 CPU `Linear` without bias, W^T stored transposed),
        or None where it would not pay: no CPU kernels, a head in another dtype or place, or
        int8 kernels without VNNI or AVX2. Its bound's basis holds, per vocabulary row j,
        ||w^_j[g]||_1 for each activation group g, then ||w_j - w^_j||_2, then ||w^_j||_2."""
        if (
            kernels is None
            or not head.transposed
            or head.dtype != torch.float32
            or head.bias is not None
            or kernel_isa() not in ("avx512-vnni", "avx2")
        ):
            return None
        weight = head.weight_view()  # [V, K]
        vocab, k = weight.shape
        group = activation_group(k)
        qweight = torch.empty(vocab, k, dtype=torch.int8)
        scales = torch.empty(vocab, 1, dtype=torch.float32)
        basis = torch.empty(k // group + 2, vocab, dtype=torch.float32)
        for start in range(0, vocab, 1024):  # bounds the float64 temporaries
            rows = weight[start : start + 1024].to(torch.float32)
            if not bool(rows.isfinite().all()):
                return None  # no bound holds: the float head answers
            q, s = quantize_rows(rows, k)
            end = start + rows.shape[0]
            qweight[start:end], scales[start:end] = q, s
            w_hat = q.to(torch.float64) * s.to(torch.float64)  # [rows, K]
            l1 = w_hat.abs().view(-1, k // group, group).sum(dim=2)  # [rows, groups]
            basis[:-2, start:end] = l1.T.to(torch.float32)
            basis[-2, start:end] = (rows.to(torch.float64) - w_hat).norm(dim=1).to(torch.float32)
            basis[-1, start:end] = w_hat.norm(dim=1).to(torch.float32)
        int8 = QuantizedWeight(
            bits=8, group_size=k, qweight=qweight, scales=scales, zeros=None, perm=None
        )
        product = build_quant_kernel(int8, None)
        if not isinstance(product.packed, PackedQuant):
            return None  # no rows kernel: its panels are what the second stage reads
        return cls(head, kernels, product, basis)

    @property
    def nbytes(self) -> int:
        """Resident bytes of the screen's own copy."""
        return self.product.nbytes + self.basis.numel() * self.basis.element_size()

    def logits(self, x: torch.Tensor, maskable_ids: Collection[int] = ()) -> torch.Tensor | None:
        """x [M, K] float32 final-norm states -> [M, V] float32: exact logits at `maskable_ids`
        (those below V; the others are no columns) and at the columns that may hold a row's
        maximum over the other columns, -inf elsewhere; None where the screen declines (more
        than MAX_ROWS rows, a row not finite, too many candidates, weights changed since the
        build)."""
        m, k = x.shape
        if m > MAX_ROWS or self.head.weights_version != self.version:
            return None
        x = x.contiguous()
        approx = self.product(x)  # [M, V]
        vocab = approx.shape[1]
        ids = sorted(i for i in maskable_ids if 0 <= i < vocab)  # others are no columns
        keep = torch.tensor(ids, dtype=torch.int64) if ids else self._no_ids
        out = torch.empty(m, vocab, dtype=torch.float32)
        storage = self.head.storage  # W^T [K, V]
        rc = self._run(
            x.data_ptr(), m, k, self.group, approx.data_ptr(), vocab, self.basis.data_ptr(),
            self.basis_max.data_ptr(), self.int8_rows.data_ptr(), self.int8_scales.data_ptr(),
            storage.data_ptr(), storage.stride(0), keep.data_ptr(), keep.numel(), MAX_NEAR,
            self._near.data_ptr(), self._refined.data_ptr(), MAX_CANDIDATES,
            self._cols.data_ptr(), self._acc.data_ptr(), out.data_ptr(),
        )  # fmt: skip
        if rc != 0:
            return None
        self.screened_rows += m
        return out
