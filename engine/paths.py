"""Where specserve keeps its prepared models: everything lives under one cache folder.

`$SPECSERVE_HOME` (default `~/.cache/specserve`) holds `models/<name>` (Hugging Face folders made
by `make models`, see `tools/prepare_models.py`) and `speculators/`. Importing this module is cheap
(no torch).
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def specserve_home() -> Path:
    """The cache folder: `$SPECSERVE_HOME`, or `~/.cache/specserve` when unset or empty."""
    env = os.environ.get("SPECSERVE_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specserve"


def models_dir() -> Path:
    return specserve_home() / "models"


def speculators_dir() -> Path:
    return specserve_home() / "speculators"


def model_path(name: str) -> Path:
    """The folder of the prepared model `name` (it may not exist yet)."""
    if not name or "/" in name or "\\" in name or name in (".", ".."):
        raise ValueError(f"invalid model name {name!r}")
    return models_dir() / name


def default_model_path() -> Path:
    return model_path(DEFAULT_MODEL_NAME)
