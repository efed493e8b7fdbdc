"""The CUDA backend every other one falls back to: Triton's, or torch's where triton is missing."""

from __future__ import annotations

from engine.attention.backend import AttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend


def triton_or_torch(block_size: int | None) -> AttentionBackend:
    """The Triton kernel's backend, or the torch backend where triton is missing."""
    try:
        from engine.attention.triton_backend import TritonBackend
    except ImportError:
        return TorchAttentionBackend(block_size or 16)
    return TritonBackend(block_size)
