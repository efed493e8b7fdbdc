"""The Triton kernels of the quantized linear layers on CUDA (engine/kernels/quant_triton.py).

`quant_linear_kernel` computes y = x @ W.T for a `QuantizedWeight` W repacked K-major: the
signed integers q as int32 words [K / PACK, N], PACK = 32 / BITS values of consecutive input
columns a word (column k in bits BITS * (k % PACK) and up, two's complement), so that a tile's
load reads BLOCK_N consecutive words of each packed row; scales fp32 [K / GROUP, N]; zeros int32
[K / GROUP, N]. Each program owns a BLOCK_M x BLOCK_N tile of the output and walks its share of
the K blocks (BLOCK_K divides GROUP, so one block has one scale row):

- weight-only (W4A16, W8A16): the block's integers, minus the zeros, become the dot's operand
  type (exact: |q - z| <= 255 fits fp16's and bf16's significands) and ``tl.dot`` sums them
  against x with fp32 accumulation; the block's product is scaled per output column.
- int8 activations (W8A8, W4A8): x arrives quantized per row and activation group of AGROUP
  columns (`quantize_rows_kernel`; BLOCK_K divides AGROUP too); the block's ``tl.dot`` of int8
  operands sums exactly in int32, the zeros are applied through the rows' block sums (q - z may
  leave int8's range), and the exact block sum is scaled in fp32 by the weight's scales and the
  rows' scales of that activation group.

With SPLIT_K > 1 the K blocks are shared by SPLIT_K programs per tile, each writing an fp32
partial to a workspace [SPLIT_K, M, N] that `reduce_splits_kernel` sums in a fixed order
(deterministic, unlike atomics), adding the bias and casting.

Specialization: M is `do_not_specialize`, so every row count of a tile shape uses one compiled
variant; x is always a whole, row-major, 16-byte aligned tensor (the caller copies a misaligned
one), so its alignment stays specialized. N, K, the packed tensors and the output are fixed for
a layer's life. `quantize_rows_kernel` reads x at any offset and row stride.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])
def quant_linear_kernel(  # type: ignore[no-untyped-def]
    out_ptr,  # [M, N] in the output dtype, or (SPLIT_K > 1) the fp32 workspace [SPLIT_K, M, N]
    x_ptr,  # [M, K] row-major: the activations (int8 with INT8_ACT), columns in perm order
    x_scale_ptr,  # INT8_ACT: fp32 [M, K // AGROUP], the rows' group scales; unused otherwise
    w_ptr,  # int32 [K // PACK, N]
    scales_ptr,  # fp32 [K // GROUP, N]
    zeros_ptr,  # HAS_ZEROS: int32 [K // GROUP, N]
    bias_ptr,  # HAS_BIAS: fp32 [N]
    M,
    N,
    K,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    AGROUP: tl.constexpr,  # INT8_ACT: columns per activation group
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    INT8_ACT: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # weight-only: the dot's operand type (x's own on CUDA)
    DOT_PRECISION: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    k_in = tl.arange(0, BLOCK_K)
    words = tl.arange(0, BLOCK_K // PACK)
    # Shifting a word's value to the top bits, then arithmetic-shifting it down, sign-extends it.
    up = 32 - BITS - tl.arange(0, PACK) * BITS  # [PACK]

    num_blocks = K // BLOCK_K
    per_split = tl.cdiv(num_blocks, SPLIT_K)
    first = pid_k * per_split
    last = tl.minimum(first + per_split, num_blocks)

    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * K + k_in[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + words[:, None] * N + cols[None, :]  # [BLOCK_K // PACK, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for block in range(first, last):
        k0 = block * BLOCK_K
        group = k0 // GROUP
        x = tl.load(x_ptrs + k0, mask=row_ok[:, None], other=0)
        packed = tl.load(w_ptrs + (k0 // PACK) * N, mask=col_ok[None, :], other=0)
        q = (packed[:, None, :] << up[None, :, None]) >> (32 - BITS)  # [BK // PACK, PACK, BN]
        q = tl.reshape(q, (BLOCK_K, BLOCK_N))  # row k: the word k // PACK, value k % PACK
        scale = tl.load(scales_ptr + group * N + cols, mask=col_ok, other=0.0)
        if INT8_ACT:
            part = tl.dot(x, q.to(tl.int8))  # int32, exact
            if HAS_ZEROS:
                zero = tl.load(zeros_ptr + group * N + cols, mask=col_ok, other=0)
                part -= tl.sum(x.to(tl.int32), axis=1)[:, None] * zero[None, :]
            x_scale = tl.load(
                x_scale_ptr + rows * (K // AGROUP) + k0 // AGROUP, mask=row_ok, other=0.0
            )
            acc += part.to(tl.float32) * scale[None, :] * x_scale[:, None]
        else:
            if HAS_ZEROS:
                zero = tl.load(zeros_ptr + group * N + cols, mask=col_ok, other=0)
                q -= zero[None, :]
            part = tl.dot(x.to(DOT_DTYPE), q.to(DOT_DTYPE), input_precision=DOT_PRECISION)  # fp32
            acc += part * scale[None, :]

    ok = row_ok[:, None] & col_ok[None, :]
    offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(out_ptr + pid_k.to(tl.int64) * M * N + offsets, acc, mask=ok)


@triton.jit(do_not_specialize=["M"])
def reduce_splits_kernel(  # type: ignore[no-untyped-def]
    out_ptr,  # [M, N] in the output dtype
    partial_ptr,  # fp32 [SPLIT_K, M, N]
    bias_ptr,  # HAS_BIAS: fp32 [N]
    M,
    N,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out = sum of the partials in split order (+ bias); BLOCK elements per program."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    size = M.to(tl.int64) * N
    ok = offsets < size
    acc = tl.load(partial_ptr + offsets, mask=ok, other=0.0)
    for split in tl.static_range(1, SPLIT_K):
        acc += tl.load(partial_ptr + split * size + offsets, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offsets % N, mask=ok, other=0.0)
    tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["stride_x"], do_not_specialize_on_alignment=["x_ptr"])
def quantize_rows_kernel(  # type: ignore[no-untyped-def]
    xq_ptr,  # int8 [M, K], row-major
    x_scale_ptr,  # fp32 [M, K // AGROUP]
    x_ptr,  # [M, K], last stride 1, any row stride and offset
    perm_ptr,  # HAS_PERM: int64 [K], the input column read for each output column
    stride_x,
    K,
    HAS_PERM: tl.constexpr,
    AGROUP: tl.constexpr,  # columns per group, dividing K and BLOCK
    BLOCK: tl.constexpr,
):
    """One row per program, `engine.quant.reference.quantize_rows`'s rule to the bit: per group
    of AGROUP columns s = max |x| / 127 (fp32, correctly rounded), xq = round-half-to-even(x /
    s) clamped to +-127 (0 for a group of zeros), after gathering the columns through perm."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    n_groups = K // AGROUP
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        src = tl.load(perm_ptr + k, mask=k < K, other=0) if HAS_PERM else k
        x = tl.load(x_row + src, mask=k < K, other=0.0).to(tl.float32)
        xg = tl.reshape(x, (BLOCK // AGROUP, AGROUP))
        scale = tl.math.div_rn(tl.max(tl.abs(xg), axis=1), 127.0)  # [BLOCK // AGROUP]
        safe = tl.where(scale > 0, scale, 1.0)
        v = tl.math.div_rn(xg, safe[:, None])
        # Adding and removing 1.5 * 2**23 rounds |v| < 2**22 to an integer, half to even.
        v = (v + 12582912.0) - 12582912.0
        v = tl.minimum(tl.maximum(v, -127.0), 127.0)
        tl.store(xq_ptr + row * K + k, tl.reshape(v, (BLOCK,)).to(tl.int8), mask=k < K)
        g = k0 // AGROUP + tl.arange(0, BLOCK // AGROUP)
        tl.store(x_scale_ptr + row * n_groups + g, scale, mask=g < n_groups)
