"""Attention over a paged KV cache for a flat varlen batch.

Each sequence contributes `query_len` new tokens, stored at cache positions
`[seq_len - query_len, seq_len)`, which attend to the sequence's cached context and, among
themselves, causally or through a per-sequence tree mask. Backends share this contract and differ
in kernels and preferred block size.
"""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata, KVCache
from engine.attention.fallback import triton_or_torch
from engine.attention.torch_backend import TorchAttentionBackend
from engine.kernels.cpu import CpuKernels

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "KVCache",
    "TorchAttentionBackend",
    "select_backend",
]


def select_backend(
    device: str,
    block_size: int | None = None,
    kernels: CpuKernels | None = None,
    dtype: torch.dtype | None = None,
    flash_attention: bool = False,
) -> AttentionBackend:
    """The attention backend for a device, its cache dtype and block size (None: its default).

    CPU: the fused C kernel when `kernels` are given, else the torch (SDPA) backend.
    CUDA: the Triton kernel (any dtype and block size); the torch backend only where triton is
    missing. With `flash_attention`, fp16/bf16 and flash-attn installed: flash-attn's paged
    kernel for steps without draft trees (blocks of a multiple of 256 tokens), the Triton
    kernel for the others.
    """
    if kernels is not None and device == "cpu":
        from engine.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend(kernels, block_size or 16)
    if not device.startswith("cuda"):
        return TorchAttentionBackend(block_size or 16)
    half = dtype in (torch.float16, torch.bfloat16)
    if flash_attention and half and (block_size is None or block_size % 256 == 0):
        try:
            from engine.attention.flash_backend import FlashAttentionBackend
        except ImportError:
            pass
        else:
            return FlashAttentionBackend(block_size)
    return triton_or_torch(block_size)
