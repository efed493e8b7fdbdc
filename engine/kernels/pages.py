"""Host memory for weights that every decode step streams: on transparent huge pages where Linux
offers them ("madvise" or "always" mode), so that a pass over hundreds of megabytes walks 2 MiB
pages instead of 4 KiB ones (fewer TLB misses for the matrix products' streams and for gathers
across a weight's rows)."""

from __future__ import annotations

import contextlib
import math
import mmap

import torch

HUGE_PAGE_MIN_BYTES = 2 << 20
"""Tensors of at least this size go on memory advised for huge pages; smaller ones cannot use
them."""


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor: from `HUGE_PAGE_MIN_BYTES` up, on fresh anonymous memory advised
    for transparent huge pages (pages are faulted in at the first write, as huge ones);
    torch.zeros below that, or where the advice is not available."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_PAGE_MIN_BYTES or advise is None:
        return torch.zeros(shape, dtype=dtype)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # THP compiled out: small pages, as torch.zeros's
        memory.madvise(advise)
    return torch.frombuffer(memory, dtype=dtype).view(shape)  # keeps `memory` alive
