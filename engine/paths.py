"""Where specserve keeps its prepared models: everything lives under one cache folder.

`$SPECSERVE_HOME` (default `~/.cache/specserve`) holds `models/<name>` (Hugging Face folders made
by `make models`, see `tools/prepare_models.py`) and `speculators/`. `find_model` also finds Hub
ids in the local Hugging Face cache, as TGIS does, without network. Importing this module is cheap
(no torch, no huggingface_hub).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
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


class ModelNotFoundError(FileNotFoundError):
    """A model (or speculator) name resolves to no folder; the message lists every place
    looked at."""


def hf_hub_cache(env: Mapping[str, str] | None = None) -> Path:
    """The Hugging Face hub cache folder, in TGIS's launcher order: `HF_HUB_CACHE`, then the
    deprecated `TRANSFORMERS_CACHE` / `HUGGINGFACE_HUB_CACHE` (ValueError when two of these
    three are set to different values), then `$HF_HOME/hub`, then
    `~/.cache/huggingface/hub`."""
    env = os.environ if env is None else env
    named = [(n, env[n]) for n in _HUB_CACHE_VARS if env.get(n)]
    if len({value for _, value in named}) > 1:
        (first, _), (other, _) = named[0], next(p for p in named if p[1] != named[0][1])
        raise ValueError(f"{other} and {first} env vars can't be set to different values")
    if named:
        return Path(named[0][1]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


_HUB_CACHE_VARS = ("HF_HUB_CACHE", "TRANSFORMERS_CACHE", "HUGGINGFACE_HUB_CACHE")


def is_hub_id(name: str) -> bool:
    """True when `name` has the shape of a Hub repo id (`name` or `org/name`), not of a path."""
    parts = name.split("/")
    return (
        len(parts) <= 2
        and all(parts)
        and not name.startswith((".", "~"))
        and "\\" not in name
        and ".." not in parts
    )


def hub_snapshot(repo_id: str, revision: str | None, cache: Path) -> Path | None:
    """The snapshot folder of `repo_id` at `revision` (a branch or tag resolved through
    `refs/<revision>`, or a commit hash; default `main`) in the HF cache folder `cache`, or None
    when the cache does not hold it. Never uses the network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        folder = snapshot_download(
            repo_id, revision=revision, cache_dir=cache, local_files_only=True
        )
    except (LocalEntryNotFoundError, HFValidationError):
        return None
    return Path(folder)


def find_model(
    name: str, revision: str | None = None, prepared: Path | None = None, what: str = "model"
) -> Path:
    """Resolve `name` to a folder (or, for a speculator, a checkpoint file), without network:

    1. an existing file or folder at the path `name` (`~` expanded);
    2. a prepared model `prepared/<name>` (default `models_dir()`) for a plain name;
    3. a Hub id (`org/name` or `name`) in the HF cache (`hf_hub_cache()`) at `revision`
       (default `main`): `models--org--name/snapshots/<commit>/`, which must hold `config.json`.

    Raises ModelNotFoundError naming every place looked at."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    looked = [f"no file or folder {path.resolve()}"]
    if "/" not in name and "\\" not in name and name not in (".", ".."):
        candidate = (prepared or models_dir()) / name
        if candidate.exists():
            return candidate
        looked.append(f"no prepared {what} {candidate}")
    if is_hub_id(name):
        cache = hf_hub_cache()
        rev = revision or "main"
        snapshot = hub_snapshot(name, revision, cache)
        if snapshot is None:
            looked.append(f"no snapshot of {name} at revision {rev} in the HF cache {cache}")
        elif not (snapshot / "config.json").is_file():
            looked.append(f"HF cache snapshot {snapshot} ({name} at {rev}) has no config.json")
        else:
            return snapshot
    raise ModelNotFoundError(f"{what} {name!r} not found: {'; '.join(looked)}")
