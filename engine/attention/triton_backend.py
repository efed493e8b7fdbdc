"""CUDA backend on one Triton kernel that reads the paged KV cache in place.

A single varlen launch serves every kind of row a step can hold: decode rows (one new token),
prefill chunks (causal among the new tokens, the whole cached context visible) and draft-tree
verification rows (a per-sequence tree mask among the new tokens). Each program owns up to
`BLOCK_Q` consecutive new tokens of one sequence and one KV head, with the `GROUP` query heads
that share that KV head stacked as rows (`BLOCK_M = BLOCK_Q * GROUP` rows), and walks the
sequence's keys `BLOCK_N` at a time through its block table with an online softmax that
accumulates in fp32.

The kernel also runs on CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1` set before
triton is first imported), which is how the tests check it against the torch backend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.attention.backend import AttentionBackend, AttentionMetadata, KVCache

BLOCK_N = 32
"""Keys per inner-loop tile; a tile may span several cache blocks."""

MIN_BLOCK_M = 16
"""Rows per program at least: `tl.dot` needs 16 on every side."""

_LOG2E = 1.4426950408889634

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


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


@triton.jit
def _paged_attention_kernel(  # type: ignore[no-untyped-def]
    out_ptr,  # [N, H, D]
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

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    for start in range(0, kv_end, BLOCK_N):
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
    o_offs = token[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :]
    tl.store(
        out_ptr + o_offs,
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


@dataclass(frozen=True)
class _Prepared:
    """Per-step kernel inputs, all slices of one device buffer filled by one host copy.

    The buffer holds the int32 arrays first, then the tree masks as bytes; `masks` is the whole
    buffer, so `mask_offsets` are byte offsets into it.
    """

    cu_q: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    mask_offsets: torch.Tensor  # [S] int32, -1 for causal sequences
    masks: torch.Tensor  # uint8


class TritonBackend(AttentionBackend):
    """Paged attention in one Triton kernel: decode, chunked prefill and draft-tree rows in the
    same launch, any block size, MHA or GQA, fp16, bf16 or fp32 with fp32 accumulation.

    The cache must be contiguous ([num_blocks, block_size, kvH, D]) and the last dimension of
    q contiguous; q itself may be a strided view. Tree masks come on the host (as the model
    runner builds them); a mask on the device is copied back, which synchronizes.
    """

    name = "triton"

    def __init__(self, block_size: int | None = None) -> None:
        self.block_size = block_size or 16

    def prepare(self, metadata: AttentionMetadata) -> None:
        device = metadata.block_tables.device
        query_lens, num_seqs = metadata.query_lens, metadata.num_seqs
        int_bytes = 4 * (3 * num_seqs + 1)
        mask_offsets: list[int] = []
        masks: list[torch.Tensor] = []
        offset = int_bytes
        for tree, n in zip(metadata.tree_masks, query_lens, strict=True):
            if tree is None:
                mask_offsets.append(-1)
                continue
            mask_offsets.append(offset)
            masks.append(tree.reshape(n * n).to("cpu", torch.uint8))
            offset += n * n
        ints = torch.tensor(
            [0, *query_lens, *metadata.seq_lens, *mask_offsets], dtype=torch.int32
        )  # [3S + 1]
        ints[: num_seqs + 1] = ints[: num_seqs + 1].cumsum(0)
        host = torch.cat([ints.view(torch.uint8), *masks])
        if device.type == "cuda":
            buf = host.pin_memory().to(device, non_blocking=True)
        else:
            buf = host.to(device)
        int_view = buf[:int_bytes].view(torch.int32)
        metadata.backend_data = _Prepared(
            cu_q=int_view[: num_seqs + 1],
            seq_lens=int_view[num_seqs + 1 : 2 * num_seqs + 1],
            mask_offsets=int_view[2 * num_seqs + 1 :],
            masks=buf,
        )

    @staticmethod
    def static_metadata(
        slot_mapping: torch.Tensor,  # [N] int64
        block_tables: torch.Tensor,  # [S, max_blocks] int32, rows may be strided
        cu_q: torch.Tensor,  # [S + 1] int32
        seq_lens: torch.Tensor,  # [S] int32, contiguous
        mask_offsets: torch.Tensor,  # [S] int32: byte offsets into `masks`, -1 when causal
        masks: torch.Tensor,  # uint8
        max_position: int,
    ) -> AttentionMetadata:
        """The metadata of a step whose kernel inputs already live in the given device tensors
        (a CUDA graph's static buffers), without `prepare`'s host copy. Its host-side lists
        are placeholders: only their number of sequences is right."""
        num_seqs = cu_q.shape[0] - 1
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            query_lens=[1] * num_seqs,
            seq_lens=[],
            block_tables=block_tables,
            max_position=max_position,
            tree_masks=[None] * num_seqs,
            backend_data=_Prepared(cu_q, seq_lens, mask_offsets, masks),
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        self.store(k, v, kv_cache, metadata.slot_mapping)
        p: _Prepared = metadata.backend_data
        key_cache, value_cache = kv_cache
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = key_cache.shape[2]
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not share {num_kv_heads} KV heads")
        if q.stride(2) != 1:
            q = q.contiguous()
        group = num_heads // num_kv_heads
        block_m = max(MIN_BLOCK_M, triton.next_power_of_2(group))
        block_q = block_m // group
        dot_dtype = q.dtype
        if q.device.type == "cpu" and q.dtype == torch.bfloat16:
            dot_dtype = torch.float32  # the interpreter's tl.dot takes no bf16
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [N, H, D]
        grid = (num_tokens // block_q + metadata.num_seqs, num_kv_heads)
        _paged_attention_kernel[grid](
            out,
            q,
            key_cache,
            value_cache,
            metadata.block_tables,
            p.cu_q,
            p.seq_lens,
            p.mask_offsets,
            p.masks,
            _LOG2E / math.sqrt(head_dim),
            metadata.num_seqs,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            metadata.block_tables.stride(0),
            HEAD_DIM=head_dim,
            HEAD_PAD=max(16, triton.next_power_of_2(head_dim)),
            GROUP=group,
            BLOCK_M=block_m,
            BLOCK_Q=block_q,
            BLOCK_N=BLOCK_N,
            PAGE=key_cache.shape[1],
            DOT_DTYPE=_TL_DTYPES[dot_dtype],
            DOT_PRECISION="ieee" if dot_dtype == torch.float32 else "tf32",
        )
        return out
