"""A model's kernel plan, chosen once per (CPU, model, build) and stored, so that a restart
installs the same kernels, and so rounds alike, without timing them again.

`choose_kernels(linears)` is what start-up calls. The plan is the kernel name per layer shape
and M bucket that `engine.kernels.autotune.select_kernels` chose, and the "rows" kernel's
prefetch mode per tile row count. It is stored as JSON under
``$SPECSERVE_HOME/kernels/plans/plan-<key>.json`` (``<tmp>/specserve-kernel-plans/`` where that
folder cannot be written), where the key is a digest of

- the CPU: its model name and feature flags (`engine.kernels.cpu.cpu_signature`), and torch's
  thread count, which the kernels' thread pools follow;
- the model, as the kernels see it: every layer's (in, out, dtype, bias) in forward order;
- the build: the kernels' sources (every file of `engine/kernels`) and torch's version.

`EngineConfig.kernel_plan` (the server's KERNEL_PLAN) says what start-up does: "reuse" (the
default) installs the stored plan, timing and storing one where none is stored; "retune" times
again and replaces the stored plan.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from engine.kernels import matmul
from engine.kernels.autotune import KernelTable, TunableLayer, select_kernels
from engine.kernels.cpu import cpu_signature
from engine.paths import specserve_home

logger = logging.getLogger(__name__)

FORMAT = 1  # of the stored JSON


def plan_dirs() -> tuple[Path, ...]:
    """Where plans are stored, in order of preference."""
    return (
        specserve_home() / "kernels" / "plans",
        Path(tempfile.gettempdir()) / "specserve-kernel-plans",
    )


def _build_digest() -> str:
    digest = hashlib.sha256(torch.__version__.encode())
    for path in sorted(Path(__file__).parent.iterdir()):
        if path.suffix in (".py", ".c", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _group(layer: TunableLayer) -> tuple[int, int]:
    return layer.in_features, layer.out_features


def plan_key(layers: list[TunableLayer]) -> dict[str, Any]:
    """What a plan is chosen for: the CPU, torch's threads, the layers and the build."""
    return {
        "cpu": cpu_signature(),
        "threads": torch.get_num_threads(),
        "layers": [
            [ly.in_features, ly.out_features, str(ly.dtype), ly.bias is not None] for ly in layers
        ],
        "build": _build_digest(),
    }


def _file_name(key: dict[str, Any]) -> str:
    text = json.dumps(key, sort_keys=True).encode()
    return f"plan-{hashlib.sha256(text).hexdigest()[:20]}.json"


def _read(name: str, key: dict[str, Any]) -> tuple[Path, dict[str, Any]] | None:
    """The first stored plan `name` whose key is `key`, with its path."""
    for folder in plan_dirs():
        path = folder / name
        try:
            stored = json.loads(path.read_text())
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            logger.warning("kernel plan %s unreadable, timing again: %s", path, e)
            continue
        if stored.get("format") == FORMAT and stored.get("key") == key:
            return path, stored
    return None


def _write(name: str, content: dict[str, Any]) -> Path | None:
    """Store `content` as `name` in the first writable folder of `plan_dirs`, atomically."""
    text = json.dumps(content, indent=1)
    for folder in plan_dirs():
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".json", dir=folder)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.chmod(tmp, 0o644)  # readable like the built kernels beside it
            os.replace(tmp, folder / name)
            return folder / name
        except OSError as e:
            logger.info("kernel plan not stored in %s: %s", folder, e)
    logger.warning("kernel plan not stored: no folder of %s is writable", plan_dirs())
    return None


def _prefetch_modes() -> dict[str, str]:
    """The "rows" kernel's prefetch mode per tile row count (empty without the kernel)."""
    from engine.kernels.rows import load_rows_gemm

    lib = load_rows_gemm()
    return {} if lib is None else {str(r): lib.prefetch(r) for r in range(2, lib.max_rows + 1)}


def _install(layers: list[TunableLayer], stored: dict[str, Any]) -> KernelTable | None:
    """Install a stored plan in `layers`; None (nothing installed) if a kernel it names cannot
    serve its layer here."""
    chosen: dict[tuple[int, int], dict[int, str]] = {}
    for shape, plan in stored["chosen"].items():
        k, n = shape.split("x")
        chosen[(int(k), int(n))] = {int(m): name for m, name in plan.items()}
    for layer in layers:
        plan = chosen.get(_group(layer))
        if not plan or any(
            name not in matmul.KERNELS or not matmul.KERNELS[name].supports(layer)
            for name in plan.values()
        ):
            return None
    table = KernelTable(threads=torch.get_num_threads(), source="stored")
    for layer in layers:
        plan = chosen[_group(layer)]
        names = set(plan.values())
        builds = {name: matmul.KERNELS[name].build(layer, table.shared) for name in names}
        layer.install({m: (name, builds[name]) for m, name in plan.items()})
    table.chosen = chosen
    if stored["prefetch"]:
        from engine.kernels.rows import load_rows_gemm

        lib = load_rows_gemm()
        assert lib is not None  # the key's build and CPU are the storing process's
        for rows, mode in stored["prefetch"].items():
            lib.set_prefetch(mode, int(rows))
    return table


def choose_kernels(linears: Iterable[TunableLayer], mode: str = "reuse") -> KernelTable:
    """Install a kernel plan in every CPU layer of `linears` (the model's, in forward order),
    after its weights are loaded: the stored plan for this CPU, model and build when there is
    one and `mode` is "reuse"; else ("retune", see `engine.config.KERNEL_PLANS`) the plan
    `select_kernels` times, which is then stored. The table says which (``source``) and where
    the plan is stored."""
    layers = [layer for layer in linears if layer.transposed]
    if not layers:
        return KernelTable(threads=torch.get_num_threads())
    t0 = time.perf_counter()
    key = plan_key(layers)
    name = _file_name(key)
    found = _read(name, key) if mode == "reuse" else None
    if found is not None:
        path, stored = found
        table = _install(layers, stored)
        if table is not None:
            table.plan_path = str(path)
            table.seconds = time.perf_counter() - t0
            logger.info("kernel plan read from %s", path)
            return table
        logger.warning("kernel plan %s names kernels unavailable here: timing again", path)
    table = select_kernels(layers)
    content = {
        "format": FORMAT,
        "key": key,
        "chosen": {f"{k}x{n}": plan for (k, n), plan in table.chosen.items()},
        "prefetch": _prefetch_modes() if table.rows_prefetch else {},
    }
    written = _write(name, content)
    table.plan_path = "" if written is None else str(written)
    logger.info("kernel plan timed in %.1f s, stored in %s", table.seconds, written)
    return table
