"""Reference backend: gathers each sequence's keys through its block table and runs SDPA with
an explicit mask. Runs on any device and any block size; the CUDA backend falls back to it for
tree masks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend, AttentionMetadata, KVCache


@dataclass(frozen=True)
class _Prepared:
    key_slots: torch.Tensor  # [S * K]: cache slot of each key position (0 where masked)
    mask: torch.Tensor | None  # [S, 1, Q, K] bool, or None when every key is visible
    query_rows: torch.Tensor | None  # [N]: row of each new token in the padded [S * Q] layout
    max_query_len: int


class TorchAttentionBackend(AttentionBackend):
    name = "torch-sdpa"

    def __init__(self, block_size: int = 16) -> None:
        self.block_size = block_size

    def prepare(self, metadata: AttentionMetadata) -> None:
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
            lens = torch.tensor(seq_lens, device=device)
            ctx_lens = lens - torch.tensor(query_lens, device=device)  # [S]
            q_pos = torch.arange(max_q, device=device)
            # Causal: new token j sees keys up to its own storage position ctx + j.
            visible = key_pos[None, None, :] <= (ctx_lens[:, None, None] + q_pos[None, :, None])
            visible &= key_pos[None, None, :] < lens[:, None, None]  # [S, Q, K]
            for i, tree in enumerate(metadata.tree_masks):
                if tree is not None:
                    ctx, n = seq_lens[i] - query_lens[i], query_lens[i]
                    visible[i, :n, ctx : ctx + n] = tree.to(device)
            for i, n in enumerate(query_lens):
                visible[i, n:, 0] = True  # padding rows: avoid an all-masked softmax
            mask = visible.unsqueeze(1)

        query_rows = None
        if any(n != max_q for n in query_lens):
            query_rows = torch.cat(
                [i * max_q + torch.arange(n, device=device) for i, n in enumerate(query_lens)]
            )
        metadata.backend_data = _Prepared(key_slots, mask, query_rows, max_q)

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
