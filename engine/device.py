"""The CUDA device a thread launches on.

CUDA keeps a current device per host thread, and every new thread starts on device 0. Triton
launches its kernels and `torch.cuda.graph` captures on the current device, so each thread that
runs the model (the one that builds the engine, the one that runs its steps) makes the
engine's device current first with `use_device`.
"""

from __future__ import annotations

import torch


def use_device(device: str | torch.device) -> None:
    """Make `device` the calling thread's current CUDA device when it is one with an index
    (`cuda:N`); no-op otherwise (CPU, or plain `cuda`: the thread's current device)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device.index)
