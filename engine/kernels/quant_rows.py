"""CPU products of float32 rows with a `QuantizedWeight`, through int8 activations.

`build_quant_kernel(weight, bias)` repacks a weight once into the layout of the rows family's
quantized tiles (`rows_quant.c`, `rows_qg.h`; per-channel int8 is one group as wide as the row)
and returns ``x [M, in] -> y [M, out]``: each row of x quantised to int8 in activation groups
(`quantize_rows`, `activation_group`), the integer products of each block summed exactly, the
blocks scaled and added in float32:
`engine.quant.reference.reference_linear(x, weight, bias, int8_activations=True)` to float32
rounding. One path serves every M: a pass over the weights takes up to 16 rows (AVX-512 VNNI),
more rows run in passes that read the weights from cache, which outran dequantising the weight
and calling a float32 GEMM at every row count measured (bench/bench_quant.py).

What it keeps, the only copy of the weight (the caller drops its `QuantizedWeight`; `unpack`
rebuilds it): the integers, one byte a weight (8 bits) or half a byte (4 bits), the output
features padded to a multiple of 16; float32 scales and, when asymmetric, int8 zeros, one each
per output feature and group; the permutation (int64 [in]) when act-ordered; the bias padded.

Without a C compiler the same product runs as ATen ops on the `QuantizedWeight` as it is,
dequantised at each call (slow: a fallback, not a path to serve from).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from engine.kernels.cpu import bind
from engine.kernels.rows import RowsGemm, load_rows_gemm
from engine.quant.reference import activation_group, dequantize_rows
from engine.quant.weights import QuantizedWeight, pack_int4

PANEL = 16
_P = ctypes.c_void_p
_I = ctypes.c_int64
# name -> (argument types, result type), in rows_gemm.c's library (rows_quant.c)
_SIGNATURES: dict[str, tuple[list[Any], Any]] = {
    "rows_gemm_qg": ([_P, _I, _P, _P, _P, _P, _I, _I, _I, _P, _P, _I, _I, _I], ctypes.c_int),
    "rows_gemm_qg_isa": ([], ctypes.c_char_p),
}


def check_supported(weight: QuantizedWeight) -> None:
    """ValueError naming the reason where the kernels cannot take `weight`: a group must be a
    multiple of 4 input columns (8 bits) or 8 (4 bits), and at most 65,536 (its integer sums
    must fit int32), and so must its blocks with the activation groups (gcd of the two)."""
    step = 4 if weight.bits == 8 else 8
    gs = weight.group_size
    if gs % step or gs > 65536:
        raise ValueError(
            f"quantized CPU kernel: a {weight.bits}-bit weight needs group_size a multiple of "
            f"{step} and at most 65536, got {gs} ([{weight.out_features}, {weight.in_features}])"
        )
    ags = activation_group(weight.in_features)
    if math.gcd(ags, gs) % step:
        raise ValueError(
            f"quantized CPU kernel: a {weight.bits}-bit weight needs activation groups ({ags} "
            f"of its {weight.in_features} input columns) whose blocks with its group_size {gs} "
            f"are a multiple of {step} columns"
        )


@dataclass(frozen=True)
class PackedQuant:
    """A `QuantizedWeight` in the tiles' layout (`rows_qg.h`)."""

    bits: int
    group_size: int
    out_features: int
    in_features: int
    packed: torch.Tensor  # uint8 [P, in / 4, 16, 4] (8 bits) or [P, in / 8, 16, 4] (4 bits)
    scales: torch.Tensor  # float32 [P, groups, 16]
    zeros: torch.Tensor | None  # int8 [P, groups, 16]
    perm: torch.Tensor | None  # int64 [in]

    @property
    def nbytes(self) -> int:
        """Bytes kept (the bias apart)."""
        kept = [self.packed, self.scales, self.zeros, self.perm]
        return sum(t.numel() * t.element_size() for t in kept if t is not None)

    def unpack(self) -> QuantizedWeight:
        """The `QuantizedWeight` this was packed from (`pack_quantized`'s inverse)."""
        panels, k = self.packed.shape[0], self.in_features
        u = self.packed
        if self.bits == 4:
            u = torch.stack((u & 0x0F, u >> 4), dim=2)  # [P, in / 8, 2, 16, 4]
        u = u.reshape(panels, k // 4, PANEL, 4).transpose(1, 2).reshape(panels * PANEL, k)
        q = (u[: self.out_features].to(torch.int16) - (128 if self.bits == 8 else 8)).to(torch.int8)
        zeros = None if self.zeros is None else _unpanel(self.zeros, self.out_features)
        return QuantizedWeight(
            bits=self.bits,
            group_size=self.group_size,
            qweight=q if self.bits == 8 else pack_int4(q),
            scales=_unpanel(self.scales, self.out_features),
            zeros=zeros,
            perm=self.perm,
        )


def _panels(t: torch.Tensor, panels: int) -> torch.Tensor:
    """[out, c] -> [panels, c, 16]: output features padded with zeros to panels * 16."""
    padded = torch.zeros((panels * PANEL, t.shape[1]), dtype=t.dtype)
    padded[: t.shape[0]] = t
    return padded.view(panels, PANEL, -1).transpose(1, 2).contiguous()


def _unpanel(t: torch.Tensor, out: int) -> torch.Tensor:
    """`_panels`' inverse: [panels, c, 16] -> [out, c]."""
    return t.transpose(1, 2).reshape(-1, t.shape[1])[:out].contiguous()


def pack_quantized(weight: QuantizedWeight) -> PackedQuant:
    """Repack `weight` as `rows_qg.h` lays it out (ValueError if unsupported, `check_supported`)."""
    check_supported(weight)
    out, k = weight.out_features, weight.in_features
    panels = -(-out // PANEL)
    offset = 128 if weight.bits == 8 else 8
    u = (weight.int_values().to(torch.int16) + offset).to(torch.uint8)  # [out, in]
    quads = _panels(u, panels).view(panels, k // 4, 4, PANEL).transpose(2, 3)  # [P, in/4, 16, 4]
    if weight.bits == 8:
        packed = quads.contiguous()
    else:
        pairs = quads.reshape(panels, k // 8, 2, PANEL, 4)
        packed = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).contiguous()
    zeros = None if weight.zeros is None else _panels(weight.zeros, panels)
    perm = None if weight.perm is None else weight.perm.to(torch.int64).contiguous()
    return PackedQuant(
        weight.bits, weight.group_size, out, k, packed, _panels(weight.scales, panels), zeros, perm
    )


def _torch_product(
    weight: QuantizedWeight, bias: torch.Tensor | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The same product as ATen ops on `weight`, dequantised at each call (no C compiler)."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        xs = x if weight.perm is None else x[:, weight.perm]
        xd = dequantize_rows(xs, activation_group(weight.in_features))
        w = weight.int_values().to(torch.float32)  # the stored (perm) column order
        if weight.zeros is not None:
            w = w - weight.zeros.to(torch.float32).repeat_interleave(weight.group_size, dim=1)
        w = w * weight.scales.repeat_interleave(weight.group_size, dim=1)
        y = xd @ w.T
        return y if bias is None else y + bias

    return forward


class RowsQuantLinear:
    """A built product (`engine.quant.kernels.QuantKernel`): `forward` over `packed`, the
    weight's only copy, or, without a C compiler, over the `QuantizedWeight` itself."""

    def __init__(
        self,
        forward: Callable[[torch.Tensor], torch.Tensor],
        packed: PackedQuant | QuantizedWeight,
        read_ahead: Callable[[], None] = lambda: None,
    ) -> None:
        """`read_ahead`: has the rows pool's idle worker read the packed weights into cache
        before the next call (`RowsGemm.read_ahead`); nothing on the ATen fallback."""
        self.forward, self.packed, self.read_ahead = forward, packed, read_ahead

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)

    def unpack(self) -> QuantizedWeight:
        packed = self.packed
        return packed.unpack() if isinstance(packed, PackedQuant) else packed

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes


def build_quant_kernel(
    weight: QuantizedWeight,
    bias: torch.Tensor | None,
    *,
    variant: Literal["native", "avx2", "scalar"] = "native",
) -> RowsQuantLinear:
    """x float32 [M, in] (CPU; any M >= 1) -> y float32 [M, out] = `reference_linear(x, weight,
    bias, int8_activations=True)` to float32 rounding. `variant` picks the build (as
    `load_rows_gemm`: "native" for this CPU; "avx2", "scalar" for tests). ValueError at build
    time for a weight the kernels cannot take (`check_supported`). Sets the rows pool's threads
    to torch's (process-wide, as the float32 rows kernel's build does). The kernel keeps the
    weight repacked (`PackedQuant`), not `weight`."""
    check_supported(weight)
    bias32 = None if bias is None else bias.detach().to(torch.float32).contiguous()
    rows = load_rows_gemm(variant)
    if rows is None:
        return RowsQuantLinear(_torch_product(weight, bias32), weight)
    pq = pack_quantized(weight)
    return RowsQuantLinear(_rows_product(rows, pq, bias32), pq, rows.read_ahead_of(pq.packed))


def _rows_product(
    rows: RowsGemm, pq: PackedQuant, bias32: torch.Tensor | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """`build_quant_kernel`'s product through the rows library."""
    rows.set_threads(torch.get_num_threads())  # process-wide, as the float rows kernel does
    padded_bias = None if bias32 is None else rows.pad_bias(bias32)
    n, k = pq.out_features, pq.in_features
    ags = activation_group(k)
    bind(rows.lib, _SIGNATURES)
    run = rows.lib.rows_gemm_qg
    ptrs = (
        pq.packed.data_ptr(),
        pq.scales.data_ptr(),
        None if pq.zeros is None else pq.zeros.data_ptr(),
    )
    perm_ptr = None if pq.perm is None else pq.perm.data_ptr()
    bias_ptr = None if padded_bias is None else padded_bias.data_ptr()
    keep = (pq, padded_bias)  # the buffers the pointers point into

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"quantized kernel: expected float32 [M, {k}], got {x.dtype} "
                             f"{list(x.shape)}")  # fmt: skip
        if x.stride(-1) != 1:
            x = x.contiguous()
        y = torch.empty((x.shape[0], n), dtype=torch.float32)
        rc = run(x.data_ptr(), x.stride(0), perm_ptr, *ptrs, pq.bits, pq.group_size, ags, bias_ptr,
                 y.data_ptr(), x.shape[0], k, n)  # fmt: skip
        if rc != 0:
            raise ValueError(f"rows_gemm_qg refused the weight ({keep[0].bits} bits)")
        return y

    return forward


def kernel_isa(variant: Literal["native", "avx2", "scalar"] = "native") -> str | None:
    """The path `build_quant_kernel` runs on for `variant` ("avx512-vnni", "avx2", "scalar"),
    None where no C compiler works (ATen fallback)."""
    rows = load_rows_gemm(variant)
    if rows is None:
        return None
    bind(rows.lib, _SIGNATURES)
    return str(rows.lib.rows_gemm_qg_isa().decode())
