"""Linear-kernel benchmark on the default model's shapes: `python -m bench.bench_kernels`.

Builds SmolLM2-135M's 121 float32 linears (30 layers x {qkv, o, gate_up, down} + lm_head) with
random weights, then

1. runs `select_kernels` as start-up does (`engine.kernels.plan_store.choose_kernels` with "retune")
   and records the kernel it installs per shape and row count (above its largest bucket, the
   kernel that bucket's kernel runs there);
2. times every candidate kernel at every (shape, rows) the engine runs: 1 to 64 rows (decode and
   verify steps) and prefill chunks of 128, 512 and 2048 rows (the head only up to 64 rows: a
   prefill chunk takes logits at its last token). Each round times every cell, and within a
   cell the candidates in turn, each for a run of calls over the shape's layers (so weights come
   from memory, as in a step), so that a slow spell of the shared host hits all candidates
   alike; a candidate's figure is its median time per call over the rounds (`time_cells`);
3. prints per (shape, rows) each candidate's median, the fastest and its margin over the next,
   then per candidate the cells where start-up picks it and the cells where it wins by 5% or
   more.

Writes bench/results/kernels.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time

import torch

from engine.kernels.autotune import DEFAULT_M_VALUES, select_kernels
from engine.kernels.matmul import KERNELS, ROWS_MAX, KernelFn
from engine.layers.linear import Linear

HIDDEN, LAYERS = 576, 30
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
LM_HEAD = (576, 49152)
DECODE_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
PREFILL_ROWS = (128, 512, 2048)
WIN = 1.05
"""A candidate wins a cell when the next-best candidate's median is at least this multiple of
its own."""
NOTABLE_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")
RESULTS = os.path.join(os.path.dirname(__file__), "results", "kernels.json")


def build_model(layers: int) -> list[Linear]:
    """Linears in model order, with N(0, 1/in) weights."""
    out = []
    for _ in range(layers):
        for k, n in SHAPES.values():
            out.append(Linear(k, n, dtype=torch.float32, device="cpu"))
    out.append(Linear(*LM_HEAD, dtype=torch.float32, device="cpu"))
    for layer in out:
        layer.storage.normal_(0.0, layer.in_features**-0.5)  # storage layout is irrelevant here
        layer.weights_version += 1
    return out


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def cpu_flags() -> list[str]:
    """The `NOTABLE_FLAGS` this CPU has."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags"))
    except (OSError, StopIteration):
        return []
    return [flag for flag in NOTABLE_FLAGS if flag in flags]


def cpu_ticks() -> tuple[int, int, int]:
    """(all ticks, busy ticks, this process's ticks) from /proc; zeros where unavailable."""
    try:
        with open("/proc/stat") as f:
            cpu = [int(v) for v in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            me = f.read().rsplit(")", 1)[1].split()
        return sum(cpu), sum(cpu) - cpu[3] - cpu[4], int(me[11]) + int(me[12])
    except (OSError, IndexError, ValueError):
        return 0, 0, 0


def served_by(name: str, m: int) -> str:
    """The kernel that runs M rows when kernel `name` is installed for them."""
    return "torch" if name == "rows" and m > ROWS_MAX else name


def startup_picks(model: list[Linear], m_values: list[int]) -> dict[tuple[int, int, int], str]:
    """(in, out, M) -> the kernel that start-up's selection runs there."""
    table = select_kernels(model)
    buckets = sorted(DEFAULT_M_VALUES)
    picks = {}
    for (k, n), plan in table.chosen.items():
        for m in m_values:
            bucket = next((b for b in buckets if b >= m), buckets[-1])
            picks[(k, n, m)] = served_by(plan[bucket], m)
    return picks


Cell = tuple[int, int, int]  # (in, out, M)


def time_cells(
    groups: dict[tuple[int, int], list[Linear]], cells: list[Cell], rounds: int, target_s: float
) -> dict[Cell, dict[str, float]]:
    """Cell -> candidate -> median ms per call over `rounds` rounds. Each round times every
    cell, and within a cell every candidate in turn (the order rotating from round to round),
    each for about `target_s` of calls over the shape's layers; a slow spell of the host thus
    falls on one round of many cells, which the medians pass over."""
    built: dict[tuple[int, int], dict[str, list[KernelFn]]] = {}
    for shape, layers in groups.items():
        specs = {name: s for name, s in KERNELS.items() if s.supports(layers[0])}
        built[shape] = {name: [s.build(ly, {}) for ly in layers] for name, s in specs.items()}
    inputs = {(k, n, m): torch.randn(m, k) for k, n, m in cells}
    jobs: dict[Cell, dict[str, tuple[list[KernelFn], int]]] = {}
    for k, n, m in cells:
        x, jobs[(k, n, m)] = inputs[(k, n, m)], {}
        for name, kernels in built[(k, n)].items():
            if served_by(name, m) != name:
                continue
            kernels[0](x)  # warm-up (a lazy kernel packs here)
            t0 = time.perf_counter()
            kernels[0](x)
            one = time.perf_counter() - t0
            calls = max(1, min(len(kernels) * 4, round(target_s / max(one, 1e-6))))
            jobs[(k, n, m)][name] = (kernels, calls)
    times: dict[Cell, dict[str, list[float]]] = {
        cell: {name: [] for name in job} for cell, job in jobs.items()
    }
    for r in range(rounds):
        for cell, job in jobs.items():
            x, names = inputs[cell], list(job)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                kernels, calls = job[name]
                t0 = time.perf_counter()
                for i in range(calls):
                    kernels[i % len(kernels)](x)
                times[cell][name].append((time.perf_counter() - t0) / calls * 1e3)
    return {
        cell: {name: statistics.median(t) for name, t in by.items()} for cell, by in times.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--target-ms", type=float, default=4.0, help="time per candidate per round")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args()

    torch.manual_seed(0)
    model = build_model(args.layers)
    groups: dict[tuple[int, int], list[Linear]] = {}
    for layer in model:
        groups.setdefault((layer.in_features, layer.out_features), []).append(layer)
    cells = [
        (k, n, m)
        for (k, n) in groups
        for m in (*DECODE_ROWS, *(PREFILL_ROWS if (k, n) != LM_HEAD else ()))
    ]
    started = datetime.datetime.now(datetime.UTC)
    ticks0 = cpu_ticks()
    with torch.inference_mode():
        t0 = time.perf_counter()
        picks = startup_picks(model, sorted({m for _, _, m in cells}))
        startup_s = time.perf_counter() - t0
        medians = time_cells(groups, cells, args.rounds, args.target_ms / 1e3)
    ticks = [b - a for a, b in zip(ticks0, cpu_ticks(), strict=True)]
    other = (ticks[1] - ticks[2]) / max(ticks[0], 1)  # CPU share used by other processes
    names = [name for name in KERNELS if any(name in row for row in medians.values())]
    print(
        f"{cpu_name()} ({', '.join(cpu_flags())}); {torch.get_num_threads()} torch threads, "
        f"{os.cpu_count()} CPUs; torch {torch.__version__}; {started:%Y-%m-%d %H:%M} UTC"
    )
    print(f"start-up selection {startup_s:.1f} s; {args.rounds} interleaved rounds per cell")
    print(f"other processes used {other:.0%} of the CPUs during the run", end="")
    print(" (contended: rerun on an idle machine)" if other > 0.05 else "")
    print("median ms per call; * = start-up's pick; margin = next best / best - 1")
    print(f"{'shape':>12} {'M':>5} " + "".join(f"{n:>10}" for n in names) + "   best  margin")
    wins: dict[str, dict[str, list[str]]] = {name: {} for name in names}
    picked: dict[str, dict[str, list[str]]] = {name: {} for name in names}
    for (k, n, m), row in medians.items():
        ranked = sorted(row, key=row.__getitem__)
        best, shape = ranked[0], f"{k}->{n}"
        margin = row[ranked[1]] / row[best] - 1 if len(ranked) > 1 else None
        if margin is not None and margin >= WIN - 1:
            wins[best].setdefault(shape, []).append(f"{m} ({margin:+.0%})")
        pick = picks[(k, n, m)]
        others = [t for name, t in row.items() if name != pick]
        text = f"{m} ({min(others) / row[pick] - 1:+.0%})" if others and pick in row else f"{m}"
        picked.setdefault(pick, {}).setdefault(shape, []).append(text)
        cells_text = "".join(
            f"{row[name]:9.3f}{'*' if name == pick else ' '}" if name in row else f"{'-':>9} "
            for name in names
        )
        margin_text = "  only" if margin is None else f"{margin:+6.1%}"
        print(f"{k:>5}->{n:<6} {m:>5} {cells_text} {best:>6} {margin_text}")
    print("\nper candidate and shape: the rows where start-up picks it (its margin over the next")
    print(f"best), and the rows where it is fastest by {WIN - 1:.0%} or more (its margin)")
    for name in picked:
        for title, by_shape in (("picked", picked[name]), ("wins", wins.get(name, {}))):
            print(
                f"{name} {title}:",
                "; ".join(f"{sh} M {', '.join(ms)}" for sh, ms in by_shape.items()) or "-",
            )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    result = {
        "cpu": cpu_name(),
        "flags": cpu_flags(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "date": started.isoformat(),
        "rounds": args.rounds,
        "startup_selection_s": startup_s,
        "other_processes_cpu_share": other,
        "cells": [
            {"shape": [k, n], "m": m, "median_ms": row, "startup_pick": picks[(k, n, m)]}
            for (k, n, m), row in medians.items()
        ],
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
