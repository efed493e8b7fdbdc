"""CPU backend: a fused C kernel stores the new K/V and attends over the paged cache in place (no
gathered copy of the context), with causal or tree masks, one call per layer.

Steps with much attention work (long prompt chunks) go to SDPA through `TorchAttentionBackend`:
its matrix-product kernels beat the C kernel's dot-product loops there. Large steps are split
across threads by sequence; ctypes releases the GIL around each call.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine.attention.backend import AttentionMetadata, KVCache
from engine.attention.torch_backend import TorchAttentionBackend
from engine.kernels.cpu import CpuKernels

FUSED_MAX_WORK = 1 << 16
"""Steps of at most this many (query, key) pairs use the C kernel; larger ones use SDPA."""

PARALLEL_MIN_WORK = 1 << 12
"""Steps of at least this many (query, key) pairs split their sequences over two threads."""


@dataclass(frozen=True)
class _Fused:
    """Per-step arguments of `store_and_attend`, built once and shared by every layer."""

    tensors: tuple[torch.Tensor, ...]  # keeps the pointed-to buffers alive
    step_args: tuple[int, ...]  # slot_mapping .. masks of the C signature, the same every layer
    seq_splits: tuple[tuple[int, int], ...]  # [begin, end) of sequences per call


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu-fused"

    def __init__(
        self, kernels: CpuKernels, block_size: int = 16, num_threads: int | None = None
    ) -> None:
        """`num_threads` (default: torch's intra-op thread count) bounds how many threads one
        large step's attention uses."""
        super().__init__(block_size)
        self.kernels = kernels
        self.num_threads = num_threads or torch.get_num_threads()
        self._pool = ThreadPoolExecutor(self.num_threads - 1) if self.num_threads > 1 else None

    def prepare(self, metadata: AttentionMetadata) -> None:
        query_lens, seq_lens = metadata.query_lens, metadata.seq_lens
        works = [q * k for q, k in zip(query_lens, seq_lens, strict=True)]
        total = sum(works)
        if total > FUSED_MAX_WORK or metadata.block_tables.device.type != "cpu":
            super().prepare(metadata)
            return
        query_start = torch.tensor([0, *query_lens], dtype=torch.int64).cumsum_(0)
        lens = torch.tensor(seq_lens, dtype=torch.int64)
        offsets, masks, offset = [], [], 0
        for tree in metadata.tree_masks:
            if tree is None:
                offsets.append(-1)
            else:
                offsets.append(offset)
                masks.append(tree.to(torch.uint8).flatten())
                offset += tree.numel()
        mask_offsets = torch.tensor(offsets, dtype=torch.int64)
        mask_bytes = torch.cat(masks) if masks else torch.zeros(1, dtype=torch.uint8)
        tables = metadata.block_tables.contiguous()
        metadata.backend_data = _Fused(
            tensors=(query_start, lens, mask_offsets, mask_bytes, tables, metadata.slot_mapping),
            step_args=(
                metadata.slot_mapping.data_ptr(),
                tables.data_ptr(),
                tables.shape[1],
                self.block_size,
                query_start.data_ptr(),
                lens.data_ptr(),
                mask_offsets.data_ptr(),
                mask_bytes.data_ptr(),
            ),
            seq_splits=self._splits(works, total),
        )

    def _splits(self, works: list[int], total: int) -> tuple[tuple[int, int], ...]:
        """Contiguous sequence ranges of about equal work, one per thread for large steps."""
        if self._pool is None or total < PARALLEL_MIN_WORK or len(works) < 2:
            return ((0, len(works)),)
        splits: list[tuple[int, int]] = []
        begin, acc = 0, 0
        share = total / self.num_threads
        for i, w in enumerate(works):
            acc += w
            if acc >= share * (len(splits) + 1) and i + 1 < len(works):
                splits.append((begin, i + 1))
                begin = i + 1
        splits.append((begin, len(works)))
        return tuple(splits)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        p = metadata.backend_data
        if not isinstance(p, _Fused):
            return super().forward(q, k, v, kv_cache, metadata)
        num_tokens, num_heads, head_dim = q.shape
        key_cache, value_cache = kv_cache
        num_kv_heads = key_cache.shape[2]
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32)
        head = (q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), k.stride(0))
        cache = (key_cache.data_ptr(), value_cache.data_ptr())
        tail = (num_heads, num_kv_heads, head_dim, 1.0 / math.sqrt(head_dim))
        run = self.kernels.store_and_attend
        if len(p.seq_splits) == 1:
            run(*head, *cache, *p.step_args, out.data_ptr(), 0, len(metadata.query_lens), *tail)
            return out
        assert self._pool is not None
        # K/V of every sequence are stored by its own call; calls touch disjoint slots.
        calls = [
            (*head, *cache, *p.step_args, out.data_ptr(), b, e, *tail) for b, e in p.seq_splits
        ]
        pending = [self._pool.submit(run, *args) for args in calls[1:]]
        run(*calls[0])
        for f in pending:
            f.result()
        return out
