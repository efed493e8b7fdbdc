"""Loads an MLP speculator from SPECULATOR_PATH and checks it against the base model.

Accepted forms (those IBM's fms-extras, fms-fsdp and TGIS write):
- an HF folder: `config.json` with `model_type: mlp_speculator` and `model.safetensors`,
  `pytorch_model.bin` or a sharded index of either;
- a torch checkpoint file holding the state dict, or a dict with it under `model_state` (fms-fsdp
  and TGIS's first speculative branch). Its config is the `config.json` beside it when that is
  a speculator config, else it is read off the tensor shapes (`n_predict` from the number of
  heads unless given; tied when a single head is stored for several heads).

Keys may carry the HF wrapper's `speculator.` prefix. Tied checkpoints may store one copy of
each shared tensor or every copy (the copies must then be equal). A folder's
`draft_vocabulary.json` (`{"token_ids": [...]}`, this project's addition) restricts drafting to
those tokens (`MLPSpeculator.restrict_vocabulary`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from engine.models.loader import CheckpointError, checkpoint_files, iter_tensors
from engine.spec_decode.mlp_speculator import MLPSpeculator
from engine.spec_decode.speculator_config import DRAFT_VOCABULARY_FILE, MLPSpeculatorConfig

_PREFIX = "speculator."
_TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


def load_speculator(
    path: str | Path,
    *,
    hidden_size: int,
    vocab_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    n_predict: int | None = None,
    draft_vocabulary: bool = True,
) -> MLPSpeculator:
    """Build and fill the speculator at `path` for a base model of `hidden_size` and
    `vocab_size`, restricted to the folder's draft vocabulary when it has one and
    `draft_vocabulary` is true. Raises CheckpointError naming the path (and tensor, or both
    mismatched values) when it cannot be used."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"{path}: speculator path does not exist")
    config, tensors = _read(path, n_predict)
    if config.emb_dim != hidden_size:
        raise CheckpointError(
            f"{path}: speculator emb_dim {config.emb_dim} does not match the base model's "
            f"hidden_size {hidden_size}"
        )
    if config.vocab_size != vocab_size:
        raise CheckpointError(
            f"{path}: speculator vocab_size {config.vocab_size} does not match the base model's "
            f"vocab_size {vocab_size}"
        )
    model = MLPSpeculator(config, dtype=dtype, device=device)
    _fill(model, tensors, path)
    vocabulary = read_draft_vocabulary(path) if draft_vocabulary and path.is_dir() else None
    if vocabulary is not None:
        try:
            model.restrict_vocabulary(vocabulary)
        except ValueError as e:
            raise CheckpointError(f"{path / DRAFT_VOCABULARY_FILE}: {e}") from e
    return model.eval()


def read_draft_vocabulary(folder: str | Path) -> torch.Tensor | None:
    """[V'] int64: the token ids of `folder`'s draft vocabulary file, or None without one.
    Raises CheckpointError when the file is unreadable."""
    path = Path(folder) / DRAFT_VOCABULARY_FILE
    if not path.is_file():
        return None
    try:
        ids = json.loads(path.read_text())["token_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise ValueError("token_ids must be a list of integers")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: unreadable draft vocabulary ({e})") from e
    return torch.tensor(ids, dtype=torch.int64)


def write_draft_vocabulary(folder: str | Path, token_ids: torch.Tensor) -> Path:
    """Write `token_ids` [V'] as `folder`'s draft vocabulary file."""
    path = Path(folder) / DRAFT_VOCABULARY_FILE
    path.write_text(json.dumps({"token_ids": token_ids.tolist()}) + "\n")
    return path


def _read(
    path: Path, n_predict: int | None
) -> tuple[MLPSpeculatorConfig, Iterator[tuple[Path, str, torch.Tensor]]]:
    if path.is_dir():
        try:
            config = MLPSpeculatorConfig.from_folder(path)
        except ValueError as e:
            raise CheckpointError(str(e)) from e
        files, _ = checkpoint_files(path)
        return config, ((f, name, t) for f in files for name, t in iter_tensors(f))
    state = _read_file(path)
    try:
        file_config = MLPSpeculatorConfig.from_folder(path.parent)
    except ValueError:  # no config.json beside it, or one of something else
        file_config = None
    config = file_config or _infer_config(state, path, n_predict)
    return config, ((path, name, t) for name, t in state.items())


def _read_file(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        return dict(iter_tensors(path))
    if path.suffix not in _TORCH_SUFFIXES:
        raise CheckpointError(
            f"{path}: not a speculator folder (with config.json) or checkpoint file "
            f"(.safetensors, {', '.join(_TORCH_SUFFIXES)})"
        )
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path}: unreadable torch checkpoint ({e})") from e
    if isinstance(state, dict) and isinstance(state.get("model_state"), dict):
        state = state["model_state"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: expected a state dict or a dict with 'model_state'")
    return state


def _infer_config(
    state: dict[str, torch.Tensor], path: Path, n_predict: int | None
) -> MLPSpeculatorConfig:
    names = {_strip(k): v for k, v in state.items()}
    for key in ("emb.0.weight", "proj.0.weight"):
        if key not in names:
            raise CheckpointError(f"{path}: missing tensor '{key}'")
    vocab, inner = names["emb.0.weight"].shape
    emb_dim = names["proj.0.weight"].shape[1]
    heads = {int(m.group(1)) for k in names if (m := re.fullmatch(r"head\.(\d+)\.weight", k))}
    n = n_predict or len(heads)
    if n < 1:
        raise CheckpointError(f"{path}: no 'head.N.weight' tensors")
    return MLPSpeculatorConfig(
        vocab_size=int(vocab),
        emb_dim=int(emb_dim),
        inner_dim=int(inner),
        n_predict=n,
        tie_weights=len(heads) == 1 and n > 1,
    )


def _strip(name: str) -> str:
    return name[len(_PREFIX) :] if name.startswith(_PREFIX) else name


def _fill(
    model: MLPSpeculator, tensors: Iterator[tuple[Path, str, torch.Tensor]], path: Path
) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: dict[int, str] = {}  # id(parameter) -> the key that filled it
    with torch.no_grad():
        for file, raw_name, tensor in tensors:
            name = _strip(raw_name)
            param = params.get(name)
            if param is None:
                raise CheckpointError(f"{file}: unexpected tensor '{raw_name}'")
            if tuple(tensor.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"{file}: tensor '{raw_name}' has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(param.shape)}"
                )
            first = loaded.get(id(param))
            if first is None:
                param.copy_(tensor)
                loaded[id(param)] = name
            elif not torch.equal(param, tensor.to(param.dtype)):
                raise CheckpointError(
                    f"{file}: tied tensor '{raw_name}' differs from '{first}' it is tied to"
                )
    for name, param in model.named_parameters():
        if id(param) not in loaded:
            raise CheckpointError(f"{path}: missing tensor '{name}'")
