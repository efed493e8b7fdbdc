"""The Triton kernels of the paged attention backend (engine/attention/triton_backend.py).

`paged_attention_kernel` serves every kind of row a step can hold: decode rows (one new token),
prefill chunks (causal among the new tokens, the whole cached context visible) and draft-tree
verification rows (a per-sequence tree mask among the new tokens). Each program owns up to
`BLOCK_Q` consecutive new tokens of one sequence and one KV head, with the `GROUP` query heads
that share that KV head stacked as rows (`BLOCK_M = BLOCK_Q * GROUP` rows), and walks the
sequence's keys `BLOCK_N` at a time through its block table with an online softmax that
accumulates in fp32.

With `SPLIT` (flash-decoding) the grid has a third axis of `num_splits` programs per (query
block, KV head), each walking one contiguous range of the keys, and the programs write their
normalized partial outputs and log-sum-exps to an fp32 workspace; `merge_splits_kernel` then
combines them per (token, head). A program's ranges are `cdiv(keys, num_splits)` keys rounded up
to `BLOCK_N` but at least `min_split_keys`, so a short context uses fewer splits than the grid
has (the others find no keys and write an empty partial).

Specialization: Triton compiles one variant per distinct key of integer arguments (equal to 1,
divisible by 16) and pointer alignment (16 bytes). Every integer that describes the batch rather
than the model (`num_seqs`, strides of q, of the output and of the block table, split counts) is
declared `do_not_specialize`, and every pointer that may be a slice of a step buffer at any
offset (q, the block table, the step's int32 arrays, the masks) `do_not_specialize_on_alignment`.
What stays specialized is fixed for a server's life: the cache strides and the alignment of the
cache, the output and the workspace, which are whole allocations. The backend's `warm_up`
compiles each variant once.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _find_seq(  # type: ignore[no-untyped-def]
    cu_q_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr
):
    """The sequence owning global query block `q_block`.

    Sequence s owns the blocks from `cu_q[s] // BLOCK_Q + s` on: at least ceil(query_len /
    BLOCK_Q) of them, so a grid of `N // BLOCK_Q + S` programs covers every sequence (the
    surplus programs find no query rows and return). Binary search for the last s whose first
    block is <= `q_block`.
    """
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(cu_q_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(
    do_not_specialize=[
        "num_seqs",
        "num_splits",
        "min_split_keys",
        "stride_q_tok",
        "stride_q_head",
        "stride_o_tok",
        "stride_o_head",
        "stride_bt",
    ],
    do_not_specialize_on_alignment=[
        "q_ptr",
        "block_tables_ptr",
        "cu_q_ptr",
        "seq_lens_ptr",
        "mask_offsets_ptr",
        "masks_ptr",
    ],
)
def paged_attention_kernel(  # type: ignore[no-untyped-def]
    out_ptr,  # [N, H, D]
    partial_ptr,  # SPLIT: fp32 [N, H, num_splits, HEAD_PAD]; unused otherwise
    lse_ptr,  # SPLIT: fp32 [N, H, num_splits], log2 of each partial's softmax sum
    q_ptr,  # [N, H, D], last stride 1
    key_cache_ptr,  # [num_blocks, block_size, kvH, D]
    value_cache_ptr,  # [num_blocks, block_size, kvH, D], the key cache's strides
    block_tables_ptr,  # [S, max_blocks] int32
    cu_q_ptr,  # [S + 1] int32: first new token of each sequence in the flat batch
    seq_lens_ptr,  # [S] int32: cached + new tokens
    mask_offsets_ptr,  # [S] int32: byte offset of the tree mask in masks_ptr, -1 when causal
    masks_ptr,  # uint8: row-major [query_len, query_len] tree masks, 1 = may attend
    scale,  # softmax scale times log2(e)
    num_seqs,
    num_splits,  # SPLIT: programs per (query block, KV head) on the grid's third axis
    min_split_keys,  # SPLIT: fewest keys of one split, a multiple of BLOCK_N
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # next power of two >= HEAD_DIM
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr,  # rows per program: BLOCK_Q query tokens x GROUP heads, padded
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,  # cache block size
    DOT_DTYPE: tl.constexpr,  # operand type of the matrix products: the inputs' own on CUDA
    DOT_PRECISION: tl.constexpr,
    SPLIT: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(cu_q_ptr, q_block, num_seqs, BLOCK_Q)
    q_begin = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_begin
    q_first = (q_block - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
    if q_first >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len
    mask_offset = tl.load(mask_offsets_ptr + seq)
    is_tree = mask_offset >= 0

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_first + rows // GROUP  # [BLOCK_M]: new-token index within the sequence
    head = kv_head * GROUP + rows % GROUP  # [BLOCK_M]
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_DIM
    token = (q_begin + q_idx).to(tl.int64)
    q_offs = token[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q = q.to(DOT_DTYPE)  # [BLOCK_M, HEAD_PAD]

    # A causal block sees keys up to its last query's own position; a tree row may see any new
    # token its mask allows.
    causal_end = tl.minimum(seq_len, ctx_len + q_first + BLOCK_Q)
    kv_end = tl.where(is_tree, seq_len, causal_end)
    first_mask_key = tl.where(is_tree, 0, q_len)  # causal sequences read no mask bytes
    if SPLIT:
        split = tl.program_id(2)
        split_len = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
        split_len = tl.maximum(split_len, min_split_keys)
        kv_begin = split * split_len
        kv_end = tl.minimum(kv_end, kv_begin + split_len)
    else:
        kv_begin = 0

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    for start in range(kv_begin, kv_end, BLOCK_N):
        pos = start + cols  # [BLOCK_N]: key positions in the sequence
        pos_ok = pos < kv_end
        block = tl.load(block_tables_ptr + seq * stride_bt + pos // PAGE, mask=pos_ok, other=0)
        kv_offs = (
            block.to(tl.int64) * stride_c_block + (pos % PAGE) * stride_c_slot
        ) + kv_head * stride_c_head  # [BLOCK_N]
        k = tl.load(
            key_cache_ptr + kv_offs[None, :] + dims[:, None],
            mask=dim_ok[:, None] & pos_ok[None, :],
            other=0.0,
        ).to(DOT_DTYPE)  # [HEAD_PAD, BLOCK_N]
        v = tl.load(
            value_cache_ptr + kv_offs[:, None] + dims[None, :],
            mask=pos_ok[:, None] & dim_ok[None, :],
            other=0.0,
        ).to(DOT_DTYPE)  # [BLOCK_N, HEAD_PAD]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale  # [BLOCK_M, BLOCK_N]

        new_j = pos - ctx_len  # [BLOCK_N]: index among the new tokens, negative in the context
        in_tree = row_ok[:, None] & (new_j[None, :] >= first_mask_key) & pos_ok[None, :]
        bits = tl.load(
            masks_ptr + mask_offset + q_idx[:, None] * q_len + new_j[None, :],
            mask=in_tree,
            other=0,
        )  # [BLOCK_M, BLOCK_N]
        among_new = tl.where(is_tree, bits != 0, new_j[None, :] <= q_idx[:, None])
        visible = pos_ok[None, :] & ((new_j[None, :] < 0) | among_new)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(DOT_DTYPE), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SPLIT:
        num_heads = tl.num_programs(1) * GROUP
        part = (token * num_heads + head) * num_splits + split  # [BLOCK_M]
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + part, lse, mask=row_ok)
        tl.store(partial_ptr + part[:, None] * HEAD_PAD + dims[None, :], acc, mask=row_ok[:, None])
    else:
        o_offs = token[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :]
        tl.store(
            out_ptr + o_offs,
            acc.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )


@triton.jit(do_not_specialize=["num_splits"])
def merge_splits_kernel(  # type: ignore[no-untyped-def]
    out_ptr,  # [N, H, D], contiguous
    partial_ptr,  # fp32 [N, H, num_splits, HEAD_PAD]
    lse_ptr,  # fp32 [N, H, num_splits]
    num_splits,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    MAX_SPLITS: tl.constexpr,  # a power of two >= num_splits
):
    """One (token, head) row per program: the partials weighted by 2^(lse - max lse), over the
    sum of the weights. Every row has at least one non-empty split (a row sees itself)."""
    row = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, MAX_SPLITS)
    split_ok = splits < num_splits
    dims = tl.arange(0, HEAD_PAD)
    lse = tl.load(lse_ptr + row * num_splits + splits, mask=split_ok, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))  # [MAX_SPLITS]; 0 for empty splits
    partial = tl.load(
        partial_ptr + (row * num_splits + splits)[:, None] * HEAD_PAD + dims[None, :],
        mask=split_ok[:, None],
        other=0.0,
    )  # [MAX_SPLITS, HEAD_PAD]
    out = tl.sum(partial * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(
        out_ptr + row * HEAD_DIM + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )
