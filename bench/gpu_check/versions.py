"""The interpreter and libraries the run needs, checked before anything else is imported.

This module must run on older Pythons (3.7 and later: no newer syntax, no imports of the
engine), so that an old interpreter gets a message instead of a SyntaxError or an ImportError
deep in a section.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

MIN_PYTHON = (3, 11)  # the engine uses enum.StrEnum and typing features of 3.11
MIN_TORCH = (2, 4)
MIN_TRITON = (3, 0)  # the CUDA attention backend's kernels


def _version(text: str) -> tuple[int, ...]:
    """(major, minor) of a version string such as '2.13.0+cu128'."""
    parts = []
    for part in text.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(str(v) for v in version)


def problems(device: str) -> list[str]:
    """What is missing or too old for a run on `device` ('cuda' or 'cpu'), one line each."""
    found = []
    if sys.version_info[:2] < MIN_PYTHON:
        found.append(
            f"Python {_dotted(MIN_PYTHON)} or newer is needed, {sys.executable} is "
            f"{sys.version.split()[0]} (run `make gpu-check PYTHON=python3.11`, or newer)"
        )
    try:
        import torch
    except ImportError:
        found.append(f"torch is not installed (torch >= {_dotted(MIN_TORCH)})")
    else:
        if _version(torch.__version__) < MIN_TORCH:
            found.append(f"torch {torch.__version__} is older than {_dotted(MIN_TORCH)}")
        if device.startswith("cuda") and not torch.version.cuda:
            found.append(f"torch {torch.__version__} is a build without CUDA")
    try:
        import triton
    except ImportError:
        if device.startswith("cuda"):
            found.append(f"triton is not installed (triton >= {_dotted(MIN_TRITON)})")
    else:
        if _version(triton.__version__) < MIN_TRITON:
            found.append(f"triton {triton.__version__} is older than {_dotted(MIN_TRITON)}")
    return found


def device_of(argv: Sequence[str]) -> str:
    """The --device the command line names (default cuda), before argparse runs."""
    device = "cuda"
    for i, arg in enumerate(argv):
        if arg == "--device" and i + 1 < len(argv):
            device = argv[i + 1]
        elif arg.startswith("--device="):
            device = arg.split("=", 1)[1]
    return device


def check_versions(device: str) -> None:
    """Exit 2 with one line per problem when a run on `device` cannot work here."""
    found = problems(device)
    if found:
        for line in found:
            print("gpu_check cannot run: " + line, file=sys.stderr)
        sys.exit(2)
