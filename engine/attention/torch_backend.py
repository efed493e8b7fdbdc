"""Reference backend: gathers each sequence's keys through its block table and runs SDPA with
an explicit mask. Runs on any device and any block size; the CUDA backend falls back to it for
tree masks.

Decode steps (one new token per sequence, no tree) take a shorter path: keys are gathered a
block at a time and no mask is built unless the sequences' lengths differ.

Small attention work (`SINGLE_THREAD_WORK`) runs on the calling thread only
(`torch.set_num_threads(1)` around it, restored after): it costs less than waking the OpenMP
workers, and where the host's cores are busy with other work each parallel region (SDPA always
opens one) waits for a busy core; decode steps on this path measured several times faster with
it on a shared 2-core host (docs/kernels.md, "Thread pools"). It is set per call, not once for
the process: the same process's prompt chunks, and the matrix products that run on torch's
pool, need all its threads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend, AttentionMetadata, KVCache
from engine.host_copy import to_device

SINGLE_THREAD_WORK = 4096
"""CPU attention of at most this many (query, key) pairs in a step runs on the calling thread."""


@dataclass(frozen=True)
class _Prepared:
    key_slots: torch.Tensor  # [S * K]: cache slot of each key position (0 where masked)
    mask: torch.Tensor | None  # [S, 1, Q, K] bool, or None when every key is visible
    query_rows: torch.Tensor | None  # [N]: row of each new token in the padded [S * Q] layout
    max_query_len: int
    single_thread: bool


@dataclass(frozen=True)
class _Decode:
    """Decode step: one query per sequence, all of them attending to their whole context."""

    max_seq_len: int
    blocks: torch.Tensor  # [S * B]: the first B blocks of each sequence, B = ceil(max_len / bs)
    mask: torch.Tensor | None  # [S, 1, 1, B * block_size] bool, only where the lengths differ
    single_thread: bool


def _single_thread(device: torch.device, work: int) -> bool:
    return device.type == "cpu" and work <= SINGLE_THREAD_WORK


class TorchAttentionBackend(AttentionBackend):
    name = "torch-sdpa"

    def __init__(self, block_size: int = 16) -> None:
        self.block_size = block_size

    def prepare(self, metadata: AttentionMetadata) -> None:
        if not metadata.has_tree and all(n == 1 for n in metadata.query_lens):
            metadata.backend_data = self._prepare_decode(metadata)
            return
        device = metadata.block_tables.device
        query_lens, seq_lens = metadata.query_lens, metadata.seq_lens
        bs = self.block_size
        max_q, max_k = max(query_lens), max(seq_lens)

        key_pos = torch.arange(max_k, device=device)  # [K]
        block_idx = (key_pos // bs).clamp_(max=metadata.block_tables.shape[1] - 1)
        blocks = metadata.block_tables.long()[:, block_idx]  # [S, K]
        key_slots = (blocks * bs + key_pos % bs).flatten()  # [S * K]

        simple_decode = max_q == 1 and all(s == max_k for s in seq_lens)
        mask = None
        if not simple_decode:
            lens, query = to_device(torch.tensor([seq_lens, query_lens]), device)  # [S] each
            ctx_lens = lens - query
            q_pos = torch.arange(max_q, device=device)
            # Causal: new token j sees keys up to its own storage position ctx + j.
            visible = key_pos[None, None, :] <= (ctx_lens[:, None, None] + q_pos[None, :, None])
            visible &= key_pos[None, None, :] < lens[:, None, None]  # [S, Q, K]
            trees = [(i, tree) for i, tree in enumerate(metadata.tree_masks) if tree is not None]
            if trees:  # all of them in one copy
                masks = to_device(torch.cat([tree.flatten() for _, tree in trees]), device)
                offset = 0
                for i, _ in trees:
                    ctx, n = seq_lens[i] - query_lens[i], query_lens[i]
                    visible[i, :n, ctx : ctx + n] = masks[offset : offset + n * n].view(n, n)
                    offset += n * n
            for i, n in enumerate(query_lens):
                visible[i, n:, 0] = True  # padding rows: avoid an all-masked softmax
            mask = visible.unsqueeze(1)

        query_rows = None
        if any(n != max_q for n in query_lens):
            query_rows = torch.cat(
                [i * max_q + torch.arange(n, device=device) for i, n in enumerate(query_lens)]
            )
        work = sum(q * k for q, k in zip(query_lens, seq_lens, strict=True))
        metadata.backend_data = _Prepared(
            key_slots, mask, query_rows, max_q, _single_thread(device, work)
        )

    def _prepare_decode(self, metadata: AttentionMetadata) -> _Decode:
        bs, seq_lens = self.block_size, metadata.seq_lens
        max_k = max(seq_lens)
        tables = metadata.block_tables[:, : -(-max_k // bs)]
        mask = None
        if any(s != max_k for s in seq_lens):
            lens = to_device(torch.tensor(seq_lens), tables.device)
            key_pos = torch.arange(tables.shape[1] * bs, device=tables.device)
            mask = (key_pos[None, :] < lens[:, None])[:, None, None, :]
        single_thread = _single_thread(tables.device, sum(seq_lens))
        return _Decode(max_k, tables.flatten().long(), mask, single_thread)

    def _decode(self, q: torch.Tensor, kv_cache: KVCache, p: _Decode) -> torch.Tensor:
        num_seqs, num_heads, head_dim = q.shape
        key_cache, value_cache = kv_cache
        num_kv_heads = key_cache.shape[2]
        gathered = (num_seqs, -1, num_kv_heads, head_dim)  # [S, B * block_size, kvH, D]
        keys = key_cache.index_select(0, p.blocks).view(gathered)
        values = value_cache.index_select(0, p.blocks).view(gathered)
        if p.mask is None:  # equal lengths: drop the last block's unused tail
            keys, values = keys[:, : p.max_seq_len], values[:, : p.max_seq_len]
        out = F.scaled_dot_product_attention(
            q.view(num_seqs, num_heads, 1, head_dim),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=p.mask,
            enable_gqa=num_kv_heads != num_heads,
        )  # [S, H, 1, D]
        return out.view(num_seqs, num_heads, head_dim)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        if not metadata.backend_data.single_thread:
            return self._forward(q, k, v, kv_cache, metadata)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self._forward(q, k, v, kv_cache, metadata)
        finally:
            torch.set_num_threads(threads)

    def _forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        self.store(k, v, kv_cache, metadata.slot_mapping)
        if isinstance(metadata.backend_data, _Decode):
            return self._decode(q, kv_cache, metadata.backend_data)
        p: _Prepared = metadata.backend_data
        num_seqs, (_, num_heads, head_dim) = metadata.num_seqs, q.shape
        if p.query_rows is not None:
            padded = q.new_zeros(num_seqs * p.max_query_len, num_heads, head_dim)
            q = padded.index_copy_(0, p.query_rows, q)
        q = q.view(num_seqs, p.max_query_len, num_heads, head_dim).transpose(1, 2)
        key_cache, value_cache = kv_cache
        num_kv_heads = key_cache.shape[2]
        gathered = (num_seqs, -1, num_kv_heads, head_dim)
        keys = key_cache.view(-1, num_kv_heads, head_dim).index_select(0, p.key_slots)
        values = value_cache.view(-1, num_kv_heads, head_dim).index_select(0, p.key_slots)
        keys, values = keys.view(gathered), values.view(gathered)  # [S, K, kvH, D]
        out = F.scaled_dot_product_attention(
            q,
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=p.mask,
            enable_gqa=num_kv_heads != num_heads,
        )  # [S, H, Q, D]
        out = out.transpose(1, 2).reshape(num_seqs * p.max_query_len, num_heads, head_dim)
        return out if p.query_rows is None else out[p.query_rows]
