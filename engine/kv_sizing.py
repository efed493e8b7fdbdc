"""How many KV blocks the pool gets.

An explicit size wins (`num_kv_blocks`, `kv_cache_tokens`, `kv_cache_memory_mb`). Otherwise, on
CPU, `CPU_KV_CACHE_MEMORY_MB`; on CUDA, what the device has left once the model is loaded and
one worst-case step has run:

    pool bytes = total * memory_fraction - (peak allocated during that step + non-torch memory)

where the peak includes the weights and every activation of the step, and non-torch memory is
what the CUDA context, cuBLAS workspaces and NCCL hold outside torch's allocator. The runner
reads these figures from a `MemoryGauge` (`CudaMemory` for its device).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.config import EngineConfig
from engine.models.llama import LlamaConfig

CPU_KV_CACHE_MEMORY_MB = 512


@dataclass(frozen=True)
class DeviceMemory:
    """Byte counts of one device, as measured after the profile step."""

    total: int  # the device's memory
    peak_allocated: int  # torch's peak during the profile step: weights + activations
    non_torch: int  # in use outside torch's allocator (CUDA context, library workspaces)


class MemoryGauge(Protocol):
    """Where the sizing rule reads one device's memory around the profile step."""

    def reset_peak(self) -> None:
        """Release the allocator's cached blocks and start a new peak (before the step)."""

    def peak_allocated(self) -> int:
        """Bytes torch's allocator held at most since `reset_peak`, once the device's queued
        work has finished."""

    def totals(self) -> tuple[int, int]:
        """(the device's total bytes, bytes in use outside torch's allocator), after releasing
        the allocator's cached blocks."""


class CudaMemory:
    """`MemoryGauge` of a CUDA device, from torch.cuda's allocator statistics and the driver."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_allocated(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def totals(self) -> tuple[int, int]:
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return total, total - free - torch.cuda.memory_reserved(self.device)


def kv_block_bytes(
    config: LlamaConfig, block_size: int, dtype: torch.dtype, num_kv_heads: int | None = None
) -> int:
    """Bytes of one block of K and V over every layer, for `num_kv_heads` (one tensor-parallel
    rank's; default: the model's)."""
    kv_heads = config.num_kv_heads if num_kv_heads is None else num_kv_heads
    per_token = 2 * config.num_layers * kv_heads * config.head_dim * dtype.itemsize
    return block_size * per_token


def num_blocks_from_memory(memory: DeviceMemory, memory_fraction: float, block_bytes: int) -> int:
    """floor((total * memory_fraction - peak_allocated - non_torch) / block_bytes), at least 0."""
    budget = memory.total * memory_fraction - memory.peak_allocated - memory.non_torch
    return max(0, math.floor(budget / block_bytes))


def kv_pool_blocks(
    config: EngineConfig,
    block_bytes: int,
    block_size: int,
    profile: Callable[[], DeviceMemory],
    on_cuda: bool,
) -> tuple[int, str]:
    """The pool's size in blocks and what set it: `config.num_kv_blocks`, else
    `config.kv_cache_tokens` (plus one block), else `config.kv_cache_memory_mb`, else on CUDA
    the device memory `profile()` measures after a worst-case step, else
    CPU_KV_CACHE_MEMORY_MB."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks, "kv_cache_blocks"
    if config.kv_cache_tokens is not None:
        num_blocks = math.ceil(config.kv_cache_tokens / block_size) + 1
        return num_blocks, f"kv_cache_tokens {config.kv_cache_tokens}"
    if config.kv_cache_memory_mb is not None or not on_cuda:
        memory_mb = config.kv_cache_memory_mb or CPU_KV_CACHE_MEMORY_MB
        return max(2, memory_mb * 2**20 // block_bytes), f"kv_cache_memory_mb {memory_mb}"
    memory = profile()
    num_blocks = num_blocks_from_memory(memory, config.memory_fraction, block_bytes)
    return num_blocks, (
        f"memory fraction {config.memory_fraction:g} of {memory.total / 2**30:.1f} GiB; "
        f"peak step {memory.peak_allocated / 2**30:.1f} GiB with the weights, "
        f"{memory.non_torch / 2**30:.1f} GiB outside torch"
    )


def check_pool(num_blocks: int, block_size: int, max_model_len: int, how: str) -> str:
    """A one-line description of the pool (tokens, max-length requests it holds); ValueError
    naming the numbers and what changes them when it cannot hold one request of
    `max_model_len` tokens. `how` says where the size came from."""
    num_tokens = num_blocks * block_size
    if num_tokens < max_model_len:
        raise ValueError(
            f"the KV cache ({how}: {num_blocks} blocks of {block_size} tokens = {num_tokens} "
            f"tokens) cannot hold one request of max_sequence_length {max_model_len}: raise "
            "kv_cache_blocks, kv_cache_memory_mb or the memory fraction "
            "(CUDA_PROCESS_MEMORY_FRACTION), or lower max_sequence_length"
        )
    return (
        f"KV cache: {num_blocks} blocks of {block_size} tokens = {num_tokens} tokens ({how}), "
        f"{num_tokens // max_model_len} requests of max_sequence_length {max_model_len}"
    )
