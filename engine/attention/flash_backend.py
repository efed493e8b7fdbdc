"""CUDA backend on flash-attn's paged varlen kernel.

The kernel reads the paged cache directly but needs blocks of a multiple of 256 tokens and takes
no custom mask, so steps that carry a draft tree run on the Triton kernel instead (the torch
backend where triton is missing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from flash_attn import flash_attn_varlen_func

from engine.attention.backend import AttentionBackend, AttentionMetadata, KVCache
from engine.attention.fallback import triton_or_torch
from engine.host_copy import to_device


@dataclass(frozen=True)
class _Prepared:
    cu_seqlens_q: torch.Tensor  # [S + 1] int32
    cu_seqlens_k: torch.Tensor  # [S + 1] int32
    max_query_len: int
    max_seq_len: int


class FlashAttentionBackend(AttentionBackend):
    name = "flash-attn"

    def __init__(self, block_size: int | None = None) -> None:
        self.block_size = block_size or 256
        if self.block_size % 256:
            raise ValueError(
                f"flash-attn's paged kernel needs a block size multiple of 256, "
                f"got {self.block_size}"
            )
        self._fallback = triton_or_torch(self.block_size)

    def prepare(self, metadata: AttentionMetadata) -> None:
        if metadata.has_tree:
            self._fallback.prepare(metadata)
            return
        device = metadata.block_tables.device
        lens = torch.tensor([[0, *metadata.query_lens], [0, *metadata.seq_lens]])
        cu_q, cu_k = to_device(lens, device).cumsum(1).int()  # one copy, from pinned memory
        metadata.backend_data = _Prepared(
            cu_q, cu_k, max(metadata.query_lens), max(metadata.seq_lens)
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        if metadata.has_tree:
            return self._fallback.forward(q, k, v, kv_cache, metadata)
        self.store(k, v, kv_cache, metadata.slot_mapping)
        p: _Prepared = metadata.backend_data
        out: torch.Tensor = flash_attn_varlen_func(
            q,
            kv_cache[0],
            kv_cache[1],
            cu_seqlens_q=p.cu_seqlens_q,
            cu_seqlens_k=p.cu_seqlens_k,
            max_seqlen_q=p.max_query_len,
            max_seqlen_k=p.max_seq_len,
            causal=True,
            block_table=metadata.block_tables,
        )
        return out
