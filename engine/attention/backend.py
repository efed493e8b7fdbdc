"""The attention backend contract and the per-step metadata every layer shares."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

KVCache = tuple[torch.Tensor, torch.Tensor]
"""One layer's (key_cache, value_cache), each [num_blocks, block_size, num_kv_heads, head_dim]."""


@dataclass
class AttentionMetadata:
    """Inputs of one forward step, built once and read by every layer.

    Sequence i owns new tokens `[query_start_loc[i], query_start_loc[i+1])` of the flat batch;
    they are written to the cache at positions `[seq_lens[i] - query_lens[i], seq_lens[i])`.
    `tree_masks[i]` is None for causal attention among the new tokens, or a bool
    [query_lens[i], query_lens[i]] matrix (True = may attend; the diagonal must be True) for a
    draft tree. Cached context is always fully visible.
    """

    slot_mapping: torch.Tensor  # [N] int64: cache slot of each new token
    query_lens: list[int]  # [S]
    seq_lens: list[int]  # [S]: cached + new tokens after this step
    block_tables: torch.Tensor  # [S, max_blocks] int32, right-padded with 0
    max_position: int  # largest RoPE position in the batch
    tree_masks: list[torch.Tensor | None]  # [S]
    backend_data: Any = field(default=None)  # filled by AttentionBackend.prepare

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def has_tree(self) -> bool:
        return any(m is not None for m in self.tree_masks)


class AttentionBackend(ABC):
    """Computes attention for new tokens after storing their K/V in the paged cache."""

    name: str
    block_size: int

    @abstractmethod
    def prepare(self, metadata: AttentionMetadata) -> None:
        """Build the backend's per-step tensors into `metadata.backend_data` (once per step)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [N, H, D]
        k: torch.Tensor,  # [N, kvH, D]
        v: torch.Tensor,  # [N, kvH, D]
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [N, H, D]
        """Write k/v at `metadata.slot_mapping`, then attend."""

    @staticmethod
    def store(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, slots: torch.Tensor) -> None:
        key_cache, value_cache = kv_cache
        key_cache.view(-1, *k.shape[1:]).index_copy_(0, slots, k)
        value_cache.view(-1, *v.shape[1:]).index_copy_(0, slots, v)
