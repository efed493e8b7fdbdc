"""Where a `ServerConfig`'s model and speculator live, and the longest sequence the model takes:
`model_name` and `speculator_path` are paths, names of prepared models, or Hub ids found in the
local HF cache (never downloaded)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

from engine.paths import find_model, is_hub_id, speculators_dir

if TYPE_CHECKING:
    from server.config import ServerConfig

MODEL_LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
DEFAULT_MAX_SEQUENCE_LENGTH = 2048
"""The config.json keys of a model's longest sequence, in TGIS's launcher order, and the length
without any of them."""


def model_max_length(model_folder: Path) -> int:
    """The first of `MODEL_LENGTH_KEYS` in the folder's config.json that holds an integer, else
    `DEFAULT_MAX_SEQUENCE_LENGTH` (also when config.json cannot be read)."""
    try:
        cfg = json.loads((model_folder / "config.json").read_text())
    except (OSError, ValueError):
        return DEFAULT_MAX_SEQUENCE_LENGTH
    for key in MODEL_LENGTH_KEYS:
        if isinstance(cfg.get(key), int):
            return int(cfg[key])
    return DEFAULT_MAX_SEQUENCE_LENGTH


def find_speculator(name: str, revision: str | None) -> Path:
    """A speculator `name` as a file or folder: a path (returned as given when it does not exist,
    for the speculator loader to name), a prepared speculator under $SPECSERVE_HOME/speculators,
    or a Hub id at `revision` in the HF cache (ModelNotFoundError naming where it looked)."""
    path = Path(name).expanduser()
    if path.exists() or not is_hub_id(name):
        return path
    return find_model(name, revision, speculators_dir(), "speculator")


def model_path(config: ServerConfig) -> Path:
    """`model_name` as a folder (`engine.paths.find_model`: a path, a prepared model, or a Hub
    id at `revision` in the HF cache); ModelNotFoundError naming where it looked."""
    return find_model(config.model_name, config.revision)


def speculator_model_path(config: ServerConfig) -> Path | None:
    """`speculator_path` at `speculator_revision` as a file or folder (`find_speculator`); None
    without a speculator."""
    if config.speculator_path is None:
        return None
    return find_speculator(config.speculator_path, config.speculator_revision)


def with_resolved_models(config: ServerConfig) -> ServerConfig:
    """A copy of `config` whose model_name (and speculator_path) are the resolved local paths,
    so that the lookup runs once; ModelNotFoundError when one is not found."""
    speculator = speculator_model_path(config)
    return dataclasses.replace(
        config,
        model_name=str(model_path(config)),
        speculator_path=None if speculator is None else str(speculator),
    )


def resolved_max_sequence_length(config: ServerConfig) -> int:
    """`max_sequence_length`, else the model's own (`model_max_length`)."""
    if config.max_sequence_length is not None:
        return config.max_sequence_length
    return model_max_length(model_path(config))
