"""One process's place in a tensor-parallel group, its collectives, and its share of a Llama
model (Megatron's split).

Rank r of N holds: heads [r H/N, (r+1) H/N) of q, o (column-parallel qkv, row-parallel o);
KV heads [r kvH/N, (r+1) kvH/N), or, with fewer KV heads than shards, the one KV head its q
heads read (replicated); columns [r I/N, (r+1) I/N) of the MLP (column-parallel gate_up,
row-parallel down); and rows [r V', (r+1) V') of the vocabulary (V' = ceil(V/N); the embedding
and the LM head). Row-parallel products and the embedding are summed over ranks with one
all-reduce each; rank 0 gathers the LM head's columns. The hidden states (after every
all-reduce) are the same on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engine.models.config import LlamaConfig


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size`. `group` runs the model's collectives (NCCL on CUDA, gloo on CPU,
    with a time limit); `control` is a CPU (gloo) group without one, for start-up agreements
    between ranks that load at different speeds. Both are None when size is 1, where every
    collective is the identity."""

    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup
    control: Any = None  # torch.distributed ProcessGroup (gloo)

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over ranks, in place; returns x."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def min(self, value: int) -> int:
        """The smallest of every rank's `value` (waits for every rank, without a time limit)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def barrier(self) -> None:
        """Wait until every rank is here (without a time limit)."""
        self.min(0)

    def gather_columns(self, x: torch.Tensor, total: int) -> torch.Tensor:
        """x [M, C] per rank -> on rank 0, [M, total]: the ranks' columns side by side, cut at
        `total`; on other ranks, x itself (their share has been sent)."""
        if self.size == 1:
            return x[:, :total] if x.shape[1] > total else x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.group)
        if parts is None:
            return x
        return torch.cat(parts, dim=1)[:, :total]


@dataclass(frozen=True)
class ShardLayout:
    """Which heads, MLP columns and vocabulary rows of a model one rank holds (ranges are
    [start, end) in the checkpoint's numbering)."""

    num_heads: int
    head_start: int
    num_kv_heads: int
    kv_head_start: int
    intermediate_size: int
    intermediate_start: int
    vocab_rows: int  # rows of the embedding and LM head this rank allocates (V')
    vocab_start: int
    vocab_end: int  # the real rows end here; vocab_rows - (vocab_end - vocab_start) pad rows

    @classmethod
    def of(cls, config: LlamaConfig, rank: int, size: int) -> ShardLayout:
        """Rank `rank`'s share; ValueError naming the model's count that `size` cannot split."""
        check_shardable(config, size)
        heads, kv_heads = config.num_heads // size, config.num_kv_heads
        if kv_heads >= size:
            kv_heads //= size
            kv_start = rank * kv_heads
        else:
            kv_start = rank * config.num_kv_heads // size
            kv_heads = 1
        inter = config.intermediate_size // size
        vocab_rows = math.ceil(config.vocab_size / size)
        vocab_start = min(rank * vocab_rows, config.vocab_size)
        return cls(
            num_heads=heads,
            head_start=rank * heads,
            num_kv_heads=kv_heads,
            kv_head_start=kv_start,
            intermediate_size=inter,
            intermediate_start=rank * inter,
            vocab_rows=vocab_rows,
            vocab_start=vocab_start,
            vocab_end=min(vocab_start + vocab_rows, config.vocab_size),
        )


def check_shardable(config: LlamaConfig, size: int) -> None:
    """ValueError unless `size` shards split the model evenly: it divides the attention heads
    and the MLP width, and the KV heads divide by it or it by them."""
    if size < 1:
        raise ValueError(f"the number of shards must be >= 1, got {size}")
    problems = []
    if config.num_heads % size:
        problems.append(f"its {config.num_heads} attention heads")
    if config.intermediate_size % size:
        problems.append(f"its MLP width {config.intermediate_size}")
    kv = config.num_kv_heads
    if kv % size and size % kv:
        problems.append(f"its {kv} KV heads (neither divides the other)")
    if problems:
        raise ValueError(
            f"{size} shards cannot split the {config.model_type} model evenly: "
            + ", ".join(problems)
            + "; choose a number of shards that divides them"
        )
