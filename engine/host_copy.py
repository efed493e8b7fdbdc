"""Copies between the host and the model's device that keep the device busy.

A copy from pageable host memory to a CUDA device, or any read of device memory on the host,
waits for the device to finish the work queued before it. A step's host-to-device inputs
therefore travel from pinned memory without waiting (`to_device`), and the step reads the device
once, at its end (`to_host`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

PINNED_DEVICE_TYPES = frozenset({"cuda"})
"""Devices whose copies from pinned host memory run asynchronously (a device-discipline test
adds its stand-in for CUDA)."""


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a CPU tensor the caller made for this copy) on `device`: itself on a CPU, else
    a copy that does not wait for the device, from pinned memory where the device has it."""
    if device.type == "cpu":
        return host
    if device.type in PINNED_DEVICE_TYPES:
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def to_host(flat: torch.Tensor) -> torch.Tensor:
    """`flat`'s values on the host, once the device has computed them: one device-to-host copy
    (into pinned memory on CUDA) and one wait. On a CPU, `flat` itself."""
    if flat.device.type == "cpu":
        return flat
    if flat.device.type != "cuda":
        return flat.cpu()
    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    torch.cuda.current_stream(flat.device).synchronize()
    return host


def read_values(parts: Sequence[torch.Tensor | None]) -> list[list[float] | None]:
    """Device tensors (any shape, values float64 holds exactly) as flat lists of floats on
    the host, all in one `to_host` copy; None stays None."""
    present = [p.flatten().double() for p in parts if p is not None]
    if not present:
        return [None] * len(parts)
    flat = to_host(present[0] if len(present) == 1 else torch.cat(present)).tolist()
    lists: list[list[float] | None] = []
    offset = 0
    for p in parts:
        if p is None:
            lists.append(None)
            continue
        lists.append(flat[offset : offset + p.numel()])
        offset += p.numel()
    return lists
