"""Returning the C heap's free memory to the operating system.

Loading a checkpoint allocates and frees many temporaries (rows read from the files, a
quantized layer's unpacked form before its kernel repacks it); glibc's malloc keeps much of
what is freed mapped for reuse, which the process's resident set counts though nothing holds
it. `release_free_heap` asks glibc to give those pages back (`malloc_trim`); where the C library
has no such call (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes


def release_free_heap() -> bool:
    """Give the heap's free pages back to the OS; whether any were (False without glibc)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return bool(trim(0))
