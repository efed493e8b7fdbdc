"""Streams HF checkpoint tensors straight into a model's final parameters.

Supported layouts: `model.safetensors`, sharded safetensors with `model.safetensors.index.json`,
and `pytorch_model.bin` (sharded or not, memory-mapped). At most one checkpoint tensor (or,
for a tensor-parallel rank, the slice of it that rank holds) is materialised at a time, so
loading never needs a second full copy of the weights.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple, Protocol

import torch
from safetensors import safe_open

from engine.layers.linear import Linear

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or does not match the model."""


class TensorSink(Protocol):
    """A destination that takes a checkpoint tensor itself (a `Linear`'s rows, a quantized
    layer's fields); ValueError when the tensor does not fit."""

    def load_rows(self, row_offset: int, weight: torch.Tensor) -> None: ...


class WeightTarget(NamedTuple):
    """Where one checkpoint tensor goes: a sink's rows from `row_offset` (a `Linear`), or a
    whole tensor, or nowhere (None: this rank holds none of it); multiplied by `scale` on the
    way (a constant of the model folded into its weights). Only rows `source_rows` and columns
    `source_cols` ([start, end), default: all) of the checkpoint tensor are read. An `optional`
    target may be absent from the checkpoint."""

    dest: TensorSink | torch.Tensor | None
    row_offset: int
    shape: tuple[int, ...]  # the checkpoint tensor's expected shape
    scale: float = 1.0
    source_rows: tuple[int, int] | None = None
    source_cols: tuple[int, int] | None = None
    optional: bool = False


class TensorSource(NamedTuple):
    """A checkpoint tensor not read yet: its shape, and `read(rows, cols)`, which reads the
    [start, end) ranges given (None: all) of its first two dimensions."""

    shape: tuple[int, ...]
    read: Callable[[tuple[int, int] | None, tuple[int, int] | None], torch.Tensor]


class Loadable(Protocol):
    def weight_targets(self) -> dict[str, WeightTarget]: ...


def checkpoint_files(folder: Path) -> tuple[list[Path], dict[str, Path]]:
    """The checkpoint's files in load order, and for sharded ones, where each tensor should be."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index_file = folder / index_name
        if index_file.is_file():
            try:
                weight_map: dict[str, str] = json.loads(index_file.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise CheckpointError(f"{index_file}: malformed index ({e})") from e
            where = {name: folder / shard for name, shard in weight_map.items()}
            files = sorted(set(where.values()))
            for f in files:
                if not f.is_file():
                    raise CheckpointError(f"{index_file}: shard {f.name} is missing")
            return files, where
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (folder / name).is_file():
            return [folder / name], {}
    raise CheckpointError(
        f"{folder}: no checkpoint found (looked for model.safetensors, "
        "model.safetensors.index.json, pytorch_model.bin, pytorch_model.bin.index.json)"
    )


def _index(rows: tuple[int, int] | None, cols: tuple[int, int] | None) -> tuple[slice, ...]:
    whole = slice(None)
    row_slice = whole if rows is None else slice(*rows)
    return (row_slice,) if cols is None else (row_slice, slice(*cols))


def iter_sources(file: Path) -> Iterator[tuple[str, TensorSource]]:
    """Yield (name, source) one at a time; a safetensors source reads only the slice asked
    for, a torch checkpoint's is a slice of the memory-mapped tensor."""
    if file.suffix != ".safetensors":
        try:
            state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
        except Exception as e:
            raise CheckpointError(f"{file}: unreadable torch checkpoint ({e})") from e
        if not isinstance(state, dict):
            raise CheckpointError(f"{file}: expected a state dict, found {type(state).__name__}")
        for name, tensor in state.items():

            def read_mapped(
                rows: tuple[int, int] | None,
                cols: tuple[int, int] | None,
                tensor: torch.Tensor = tensor,
            ) -> torch.Tensor:
                return tensor[_index(rows, cols)]

            yield name, TensorSource(tuple(tensor.shape), read_mapped)
        return
    try:
        f = safe_open(str(file), framework="pt")
        names = list(f.keys())
    except Exception as e:  # SafetensorError derives from Exception only
        raise CheckpointError(f"{file}: unreadable safetensors file ({e})") from e
    for name in names:

        def read(
            rows: tuple[int, int] | None, cols: tuple[int, int] | None, name: str = name
        ) -> torch.Tensor:
            try:
                if rows is None and cols is None:
                    return f.get_tensor(name)
                return f.get_slice(name)[_index(rows, cols)]
            except Exception as e:
                raise CheckpointError(f"{file}: tensor '{name}' is unreadable ({e})") from e

        try:
            shape = tuple(f.get_slice(name).get_shape())
        except Exception as e:
            raise CheckpointError(f"{file}: tensor '{name}' is unreadable ({e})") from e
        yield name, TensorSource(shape, read)


def iter_tensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one at a time, on the CPU (a torch checkpoint's memory-mapped)."""
    for name, source in iter_sources(file):
        yield name, source.read(None, None)


def load_weights(model: Loadable, folder: str | Path) -> None:
    """Copy every checkpoint tensor into `model.weight_targets()`; every target must be filled.

    Raises CheckpointError naming the file and the tensor for a missing, unexpected or
    mis-shaped tensor. A scaled tensor is multiplied in float32 (one temporary of its size) and
    rounded once to the destination's dtype.
    """
    folder = Path(folder)
    targets = model.weight_targets()
    files, where = checkpoint_files(folder)
    loaded: set[str] = set()
    for file in files:
        for name, source in iter_sources(file):
            if name.endswith(IGNORED_SUFFIXES):
                continue
            if name not in targets:
                if name == "lm_head.weight" and "lm_head.qweight" not in targets:
                    continue  # a tied checkpoint that also stores the head
                raise CheckpointError(f"{file}: unexpected tensor '{name}'")
            dest, row_offset, shape, scale, source_rows, source_cols, _ = targets[name]
            if source.shape != shape:
                raise CheckpointError(
                    f"{file}: tensor '{name}' has shape {source.shape}, expected {shape}"
                )
            loaded.add(name)
            if dest is None:
                continue
            tensor = source.read(source_rows, source_cols)
            if scale != 1.0:
                tensor = tensor.to(torch.float32) * scale
            if isinstance(dest, torch.Tensor):
                with torch.no_grad():
                    dest.copy_(tensor)
            elif isinstance(dest, Linear):
                dest.load_rows(row_offset, tensor)
            else:
                try:
                    dest.load_rows(row_offset, tensor)
                except ValueError as e:
                    raise CheckpointError(f"{file}: tensor '{name}': {e}") from e
    missing = sorted(n for n, t in targets.items() if n not in loaded and not t.optional)
    if missing:
        name = missing[0]
        file_hint = where.get(name, files[0] if len(files) == 1 else folder)
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{file_hint}: missing tensor '{name}'{more}")
