"""Quantized linear weights in one logical form, shared by the loaders and the kernels.

A `QuantizedWeight` stands for a float matrix W [out, in] (HF layout) as integers with per-group
float scales and optional zero points:

    W'[o, i] = scales[o, i // group_size] * (q[o, i] - zeros[o, i // group_size])
    W[:, perm] = W'   (W' is W with its input columns in `perm` order; perm None: W' = W)

so that ``x @ W.T == x[:, perm] @ W'.T``: a kernel gathers the activations' columns once and then
reads contiguous groups (how GPTQ's act-order, whose groups are scattered over the input
columns, becomes a plain grouped matrix).

The integers q are signed. 8 bits: ``qweight`` is int8 [out, in], q = qweight. 4 bits:
``qweight`` is uint8 [out, in / 2], two values a byte, column 2j in the low nibble and 2j + 1 in
the high one, each stored as the unsigned nibble u = q + 8 (so q is in [-8, 7]). ``zeros`` are
signed too (GPTQ's unsigned zero point minus 2**(bits - 1)); None means 0 (symmetric). The loader
converts whatever a checkpoint stores into this form; kernels may repack it into their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_BITS = (4, 8)


@dataclass(frozen=True)
class QuantizedWeight:
    """W [out_features, in_features] as grouped integers (see the module docstring)."""

    bits: int
    group_size: int  # input columns per group; in_features for one scale per output row
    qweight: torch.Tensor  # int8 [out, in] (8 bits) or uint8 [out, in // 2] (4 bits)
    scales: torch.Tensor  # float32 [out, in // group_size]
    zeros: torch.Tensor | None  # int8 [out, in // group_size], signed; None: symmetric
    perm: torch.Tensor | None  # int64 [in]: the input column order of the stored W'

    def __post_init__(self) -> None:
        out, n_groups = self.scales.shape
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(
                f"QuantizedWeight: bits must be one of {SUPPORTED_BITS}, got {self.bits}"
            )
        if self.group_size <= 0 or n_groups * self.group_size != self.in_features:
            raise ValueError(
                f"QuantizedWeight: group_size {self.group_size} and {n_groups} groups do not "
                f"cover {self.in_features} input columns"
            )
        if self.qweight.shape[0] != out:
            raise ValueError(
                f"QuantizedWeight: qweight has {self.qweight.shape[0]} rows, scales {out}"
            )
        expected = torch.int8 if self.bits == 8 else torch.uint8
        if self.qweight.dtype != expected or self.scales.dtype != torch.float32:
            raise ValueError(
                f"QuantizedWeight: {self.bits}-bit qweight must be {expected} with float32 "
                f"scales, got {self.qweight.dtype} and {self.scales.dtype}"
            )
        if self.zeros is not None and tuple(self.zeros.shape) != (out, n_groups):
            raise ValueError(
                f"QuantizedWeight: zeros shape {list(self.zeros.shape)}, "
                f"expected [{out}, {n_groups}]"
            )
        if self.perm is not None and tuple(self.perm.shape) != (self.in_features,):
            raise ValueError(
                f"QuantizedWeight: perm shape {list(self.perm.shape)}, "
                f"expected [{self.in_features}]"
            )

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[1]) * (8 // self.bits)

    @property
    def nbytes(self) -> int:
        """Bytes of the integers, scales, zeros and permutation."""
        kept = [self.qweight, self.scales, self.zeros, self.perm]
        return sum(t.numel() * t.element_size() for t in kept if t is not None)

    def int_values(self) -> torch.Tensor:
        """q as int8 [out, in], in the stored (perm) column order."""
        if self.bits == 8:
            return self.qweight
        low = (self.qweight & 0x0F).to(torch.int8) - 8
        high = (self.qweight >> 4).to(torch.int8) - 8
        return torch.stack((low, high), dim=-1).reshape(self.out_features, self.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float W [out, in] this weight stands for, in the original column order."""
        q = self.int_values().to(torch.float32)
        if self.zeros is not None:
            q = q - self.zeros.to(torch.float32).repeat_interleave(self.group_size, dim=1)
        w_stored = q * self.scales.repeat_interleave(self.group_size, dim=1)
        if self.perm is None:
            return w_stored.to(dtype)
        w = torch.empty_like(w_stored)
        w[:, self.perm] = w_stored
        return w.to(dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Signed 4-bit values q int8 [out, in] (in [-8, 7], in even) -> the uint8 [out, in / 2]
    nibble packing of `QuantizedWeight.qweight`."""
    if q.dim() != 2 or q.shape[1] % 2 or int(q.min()) < -8 or int(q.max()) > 7:
        raise ValueError("pack_int4: expected int values in [-8, 7] of shape [out, even in]")
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4)
