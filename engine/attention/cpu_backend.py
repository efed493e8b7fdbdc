"""CPU backend: a fused C kernel stores the new K/V and attends over the paged cache in place (no
gathered copy of the context), with causal or tree masks, one call per layer.

Steps with much attention work (long prompt chunks) go to SDPA through `TorchAttentionBackend`:
its matrix-product kernels beat the C kernel's dot-product loops there. The C kernel runs on the
threads of the "rows" matrix kernel's pool (`engine/kernels/unit_pool.h`), in units of one key
head and a few query rows of one sequence, so that one sequence's attention uses every core. It
writes every layer's output to one buffer (`engine.kernels.buffers`): what a call returns is
valid until the next call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.attention.backend import AttentionMetadata, KVCache
from engine.attention.torch_backend import TorchAttentionBackend
from engine.kernels.buffers import OutputBuffer
from engine.kernels.cpu import CpuKernels
from engine.kernels.rows import load_rows_gemm

FUSED_MAX_WORK = 1 << 16
"""Steps of at most this many (query, key) pairs use the C kernel; larger ones use SDPA."""


@dataclass(frozen=True)
class _Fused:
    """Per-step arguments of `store_and_attend`, built once and shared by every layer."""

    tensors: tuple[torch.Tensor, ...]  # keeps the pointed-to buffers alive
    step_args: tuple[int, ...]  # slot_mapping .. masks of the C signature, the same every layer


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu-fused"

    def __init__(self, kernels: CpuKernels, block_size: int = 16, parallel: bool = True) -> None:
        """With `parallel` (and the rows library built), attention runs on the pool's threads
        (as many as `RowsGemm.set_threads` set), else on the calling thread."""
        super().__init__(block_size)
        self.kernels = kernels
        rows = load_rows_gemm() if parallel else None
        self.pool_run_address = rows.pool_run_address if rows is not None else 0
        self.output = OutputBuffer()

    def prepare(self, metadata: AttentionMetadata) -> None:
        query_lens, seq_lens = metadata.query_lens, metadata.seq_lens
        total = sum(q * k for q, k in zip(query_lens, seq_lens, strict=True))
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
        )

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
        out = self.output.take(num_tokens, num_heads, head_dim)
        head = (q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), k.stride(0))
        cache = (key_cache.data_ptr(), value_cache.data_ptr())
        tail = (num_heads, num_kv_heads, head_dim, 1.0 / math.sqrt(head_dim))
        self.kernels.store_and_attend(
            *head, *cache, *p.step_args, out.data_ptr(), len(metadata.query_lens), *tail,
            self.pool_run_address,
        )  # fmt: skip
        return out
