"""Attention over a paged KV cache for a flat varlen batch.

Each sequence contributes `query_len` new tokens, stored at cache positions
`[seq_len - query_len, seq_len)`, which attend to the sequence's cached context and, among
themselves, causally or through a per-sequence tree mask. Backends share this contract and differ
in kernels and preferred block size.
"""

from __future__ import annotations

from engine.attention.backend import AttentionBackend, AttentionMetadata, KVCache
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
    device: str, block_size: int | None = None, kernels: CpuKernels | None = None
) -> AttentionBackend:
    """flash-attn's paged kernel on CUDA when installed; the fused C kernel on CPU when `kernels`
    are given; else the torch (SDPA) backend."""
    if kernels is not None and device == "cpu":
        from engine.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend(kernels, block_size or 16)
    if device.startswith("cuda"):
        try:
            from engine.attention.flash_backend import FlashAttentionBackend
        except ImportError:
            pass
        else:
            return FlashAttentionBackend(block_size)
    return TorchAttentionBackend(block_size or 16)
