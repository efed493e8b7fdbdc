"""Quantized linear layers on CUDA: a `QuantizedWeight` repacked for the Triton kernels of
engine/kernels/quant_triton_kernels.py, and the launches of one product.

`build_quant_kernel_cuda(weight, bias, int8_activations=..., dtype=...)` returns a
`TritonQuantLinear`, a callable x [M, in] -> y [M, out] in `dtype` that computes
`engine.quant.reference.reference_linear`:

- weight-only (GPTQ: W4A16, W8A16): x's columns are gathered through the weight's `perm` once
  (``index_select``), then one launch dequantizes the integers in registers and sums with
  ``tl.dot`` in x's dtype with fp32 accumulation;
- int8 activations (W8A8, W4A8): one launch quantizes x's rows in activation groups
  (`engine.quant.reference.activation_group`; gathering through `perm`), one multiplies with
  int8 ``tl.dot`` and int32 accumulation, K blocks inside one activation group.

Layout: the integers are repacked K-major, int32 words [in / PACK, out] holding PACK = 32 / bits
consecutive input columns (GPTQ's own qweight layout, with signed values), so that the BLOCK_N
columns of a tile are BLOCK_N consecutive words of each packed row: every load is coalesced and
reads whole 32-byte sectors, and one word gives PACK values of the K dimension the dot sums over.
Scales stay fp32 [in / group_size, out] (a 4-bit layer with groups of 128 reads 1/16 of a byte
per weight for them).

Tiles (`choose_tiles`) depend on M through four tiers, so a layer has at most four variants of
each kernel, all compiled by `warm_up`. A step never compiles and never synchronizes: M is not
specialized, every buffer's shape follows from M alone, and nothing reads device values on the
host, so the calls can be captured in CUDA graphs per row-count bucket.

Under Triton's interpreter (`TRITON_INTERPRET=1`) the same launches run on CPU tensors, which is
how the tests check them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.quant_triton_kernels import (
    quant_linear_kernel,
    quantize_rows_kernel,
    reduce_splits_kernel,
)
from engine.quant.reference import activation_group
from engine.quant.weights import QuantizedWeight, pack_int4

ROW_TIERS = (16, 32, 64)
"""BLOCK_M of the row counts up to each value; larger M take `PREFILL_BLOCK_M`."""

PREFILL_BLOCK_M = 64

MAX_SPLIT_K = 8

MIN_BLOCKS_PER_SPLIT = 4
"""Fewest K blocks one split walks, so that its loads can be pipelined (num_stages)."""

WAVES = 2
"""Programs per multiprocessor a small-M grid is split over K to reach: with 3 pipeline stages
of a 4-bit 128 x 64 tile (4 KiB of weights), two programs keep about 24 KiB of loads in flight
per multiprocessor, what an H100's bandwidth times its memory latency asks for."""

QUANTIZE_BLOCK = 1024
"""Columns per iteration of the activation-quantizing kernel."""

REDUCE_BLOCK = 1024

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@dataclass(frozen=True)
class Tiles:
    """One launch shape of `quant_linear_kernel`."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


def block_k_for(group_size: int, cap: int) -> int:
    """The largest power of two that divides `group_size`, at most `cap`."""
    return min(group_size & -group_size, cap)


def choose_tiles(m: int, n: int, k: int, group_size: int, num_sms: int) -> Tiles:
    """The tiles for M rows of an [n, k] layer on `num_sms` multiprocessors.

    Up to 64 rows (decode and verify steps) the product is bound by reading the weights: tiles
    of 64 output columns and up to 128 input columns (4 KiB of a 4-bit weight a stage), BLOCK_M
    the smallest of 16/32/64 that holds M, and when the output tiles do not give every
    multiprocessor `WAVES` programs, K is split over up to `MAX_SPLIT_K` programs per tile (a
    13B layer with 5120 outputs has 80 column tiles: split 4 ways, 320 programs on 132 SMs).
    Above 64 rows (prefill chunks) the product is bound by arithmetic: 64 x 128 tiles, 64
    input columns a step, no split.
    """
    if m > ROW_TIERS[-1]:
        return Tiles(PREFILL_BLOCK_M, 128, block_k_for(group_size, 64), 1, 4, 3)
    block_m = next(t for t in ROW_TIERS if m <= t)
    block_n, block_k = 64, block_k_for(group_size, 128)
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    num_blocks = k // block_k
    split = 1
    while (
        tiles * split < WAVES * num_sms
        and split < MAX_SPLIT_K
        and num_blocks // (2 * split) >= MIN_BLOCKS_PER_SPLIT
    ):
        split *= 2
    return Tiles(block_m, block_n, block_k, split, 4, 3)


def unsupported_reason(weight: QuantizedWeight, int8_activations: bool) -> str | None:
    """Why the Triton kernels cannot serve `weight`, or None: ``tl.dot`` sums at least 16 input
    columns (32 of int8) a block, and a block must not straddle two groups (weight groups, and
    activation groups with int8 activations)."""
    least = 32 if int8_activations else 16
    if weight.group_size % least:
        return (
            f"group size {weight.group_size} is not a multiple of {least} "
            f"(the Triton {'W8A8' if int8_activations else 'weight-only'} kernel's K block)"
        )
    if int8_activations and activation_group(weight.in_features) % least:
        return (
            f"in_features {weight.in_features} is not a multiple of {least} (the activation "
            "groups of the Triton W8A8 kernel's K block)"
        )
    return None


def pack_k_major(weight: QuantizedWeight) -> torch.Tensor:
    """q int8 [out, in] -> int32 [in / PACK, out]: word [i, o] holds q[o, i * PACK + j] in bits
    `bits * j` and up, two's complement (see the module docstring). Works in int32 without
    overflow (the top value keeps its sign, the others are masked), a few bytes per weight of
    scratch on the weight's device."""
    bits, pack = weight.bits, 32 // weight.bits
    q = weight.int_values().T.reshape(weight.in_features // pack, pack, weight.out_features)
    words = torch.zeros(q.shape[0], q.shape[2], dtype=torch.int32, device=q.device)
    for j in range(pack):
        value = q[:, j].to(torch.int32)
        if j < pack - 1:
            value &= (1 << bits) - 1
        words |= value * (1 << (bits * j))
    return words


class TritonQuantLinear:
    """y = x @ W.T + bias for one `QuantizedWeight` on the Triton kernels; see the module
    docstring. Holds only the repacked tensors, on the weight's device (the caller drops its
    `QuantizedWeight`; `unpack` rebuilds it)."""

    def __init__(
        self,
        weight: QuantizedWeight,
        bias: torch.Tensor | None,
        *,
        int8_activations: bool,
        dtype: torch.dtype,
        num_sms: int | None = None,
    ) -> None:
        reason = unsupported_reason(weight, int8_activations)
        if reason is not None:
            raise ValueError(f"build_quant_kernel_cuda: {reason}")
        if dtype not in _TL_DTYPES:
            raise ValueError(f"build_quant_kernel_cuda: dtype {dtype} is not fp16, bf16 or fp32")
        device = weight.qweight.device
        self.bits, self.group_size = weight.bits, weight.group_size
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.int8_activations, self.dtype, self.device = int8_activations, dtype, device
        self.act_group = activation_group(self.in_features)
        # a K block lies inside one weight group and, with int8 activations, one activation group
        self.block_group = self.group_size
        if int8_activations:
            self.block_group = math.gcd(self.group_size, self.act_group)
        self.words = pack_k_major(weight)  # int32 [in / PACK, out]
        self.scales = weight.scales.T.contiguous()  # fp32 [groups, out]
        self.zeros = None if weight.zeros is None else weight.zeros.T.to(torch.int32).contiguous()
        self.perm = None if weight.perm is None else weight.perm.to(device, torch.int64)
        self.bias = None if bias is None else bias.to(device, torch.float32).contiguous()
        if num_sms is None:
            cuda = device.type == "cuda"
            num_sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 1
        self.num_sms = num_sms
        self.dot_dtype = dtype
        if device.type == "cpu" and dtype == torch.bfloat16:
            self.dot_dtype = torch.float32  # the interpreter's tl.dot takes no bf16

    @property
    def nbytes(self) -> int:
        """Resident bytes of the repacked weight (the bias apart)."""
        kept = [self.words, self.scales, self.zeros, self.perm]
        return sum(t.numel() * t.element_size() for t in kept if t is not None)

    def unpack(self) -> QuantizedWeight:
        """The `QuantizedWeight` this was built from (`pack_k_major`'s inverse), on the
        weight's device."""
        bits = self.bits
        shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=self.words.device)
        values = (self.words.unsqueeze(1) >> shifts.view(1, -1, 1)) & ((1 << bits) - 1)
        values = values - (values >= (1 << (bits - 1))).to(torch.int32) * (1 << bits)
        q = values.reshape(self.in_features, self.out_features).T.to(torch.int8).contiguous()
        return QuantizedWeight(
            bits=bits,
            group_size=self.group_size,
            qweight=q if bits == 8 else pack_int4(q),
            scales=self.scales.T.contiguous(),
            zeros=None if self.zeros is None else self.zeros.T.to(torch.int8).contiguous(),
            perm=self.perm,
        )

    def tiles(self, m: int) -> Tiles:
        return choose_tiles(m, self.out_features, self.in_features, self.block_group, self.num_sms)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] in the build's dtype, on the weight's device -> y [M, out] in that dtype."""
        m, k = x.shape
        n = self.out_features
        if k != self.in_features or x.dtype != self.dtype:
            raise ValueError(
                f"x is {x.dtype} [{m}, {k}]; the kernel takes {self.dtype} [M, {self.in_features}]"
            )
        out = torch.empty((m, n), dtype=self.dtype, device=x.device)
        if m == 0:
            return out
        x_scale = out  # unused by the weight-only kernel
        if self.int8_activations:
            x, x_scale = quantize_activations(x, self.perm, self.act_group)
        else:
            if self.perm is not None:
                x = x.index_select(1, self.perm)  # a whole new tensor
            elif x.stride(1) != 1 or (m > 1 and x.stride(0) != k) or x.data_ptr() % 16:
                x = x.clone(memory_format=torch.contiguous_format)  # keeps alignment specialized
        t = self.tiles(m)
        target = out
        if t.split_k > 1:
            target = torch.empty((t.split_k, m, n), dtype=torch.float32, device=x.device)
        with _on(x.device):
            quant_linear_kernel[(triton.cdiv(n, t.block_n), t.split_k, triton.cdiv(m, t.block_m))](
                target,
                x,
                x_scale,
                self.words,
                self.scales,
                self.words if self.zeros is None else self.zeros,
                out if self.bias is None else self.bias,
                m,
                n,
                k,
                BITS=self.bits,
                GROUP=self.group_size,
                AGROUP=self.act_group,
                BLOCK_M=t.block_m,
                BLOCK_N=t.block_n,
                BLOCK_K=t.block_k,
                SPLIT_K=t.split_k,
                INT8_ACT=self.int8_activations,
                HAS_ZEROS=self.zeros is not None,
                HAS_BIAS=self.bias is not None,
                DOT_DTYPE=_TL_DTYPES[self.dot_dtype],
                DOT_PRECISION="ieee" if self.dot_dtype == torch.float32 else "tf32",
                num_warps=t.num_warps,
                num_stages=t.num_stages,
            )
            if t.split_k > 1:
                reduce_splits_kernel[(triton.cdiv(m * n, REDUCE_BLOCK),)](
                    out,
                    target,
                    out if self.bias is None else self.bias,
                    m,
                    n,
                    SPLIT_K=t.split_k,
                    HAS_BIAS=self.bias is not None,
                    BLOCK=REDUCE_BLOCK,
                )
        return out

    def row_tiers(self, max_rows: int) -> list[int]:
        """The fewest rows of each distinct launch shape among 1..`max_rows` rows (above
        `ROW_TIERS[-1]` rows the shape no longer depends on M)."""
        seen: dict[Tiles, int] = {}
        for m in range(1, min(max_rows, ROW_TIERS[-1] + 1) + 1):
            seen.setdefault(self.tiles(m), m)
        return sorted(seen.values())

    def warm_up(self, max_rows: int) -> int:
        """Compile every variant that calls of 1..`max_rows` rows launch, by calling once per
        launch shape on zeros. Returns the number of calls."""
        tiers = self.row_tiers(max_rows)
        for m in tiers:
            self(torch.zeros((m, self.in_features), dtype=self.dtype, device=self.device))
        return len(tiers)


def build_quant_kernel_cuda(
    weight: QuantizedWeight,
    bias: torch.Tensor | None,
    *,
    int8_activations: bool,
    dtype: torch.dtype,
    num_sms: int | None = None,
) -> TritonQuantLinear:
    """The Triton product of `weight` (see the module docstring): x [M, in] in `dtype` (fp16 or
    bf16; fp32 for tests) on the weight's device -> [M, out] in `dtype`. `num_sms`: the
    multiprocessors small-M grids fill (None: the device's; 1 off CUDA). Raises ValueError for
    a weight the kernels cannot serve (`unsupported_reason`)."""
    return TritonQuantLinear(
        weight, bias, int8_activations=int8_activations, dtype=dtype, num_sms=num_sms
    )


def quantize_activations(
    x: torch.Tensor, perm: torch.Tensor | None = None, group_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype, last stride 1 or copied so) -> (xq int8 [M, K] with its
    columns gathered through `perm`, fp32 [M, K / group_size] scales): `quantize_rows`'s rule
    to the bit, one program a row. `group_size`: a power of two dividing K (None:
    `activation_group(K)`)."""
    m, k = x.shape
    group = activation_group(k) if group_size is None else group_size
    if group & (group - 1) or k % group:
        raise ValueError(f"quantize_activations: group {group} is no power of two dividing {k}")
    if x.stride(1) != 1:
        x = x.contiguous()
    xq = torch.empty((m, k), dtype=torch.int8, device=x.device)
    x_scale = torch.empty((m, k // group), dtype=torch.float32, device=x.device)
    if m == 0:
        return xq, x_scale
    with _on(x.device):
        quantize_rows_kernel[(m,)](
            xq,
            x_scale,
            x,
            xq if perm is None else perm,
            x.stride(0),
            k,
            HAS_PERM=perm is not None,
            AGROUP=group,
            BLOCK=max(group, min(QUANTIZE_BLOCK, triton.next_power_of_2(k))),
        )
    return xq, x_scale


@contextmanager
def _on(device: torch.device) -> Iterator[None]:
    """Triton compiles for, and launches on, the current device: make it the tensors'."""
    with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
        yield
