"""Linear-kernel benchmark for SmolLM2-135M's shapes: `python -m bench.bench_kernels`.

Builds the model's 121 fp32 linears (30 layers x {qkv, o, gate_up, down} + lm_head) with random
weights so every timed call reads cold weights as in a real decode step, runs `select_kernels`
with all kernels timed (no pruning), prints ms per call and GB/s per kernel, shape and M (the chosen
kernel marked *), then
  * a storage-layout check: OpenBLAS and oneDNN on W^T [in, out] (what Linear stores) against a
    contiguous W [out, in];
  * a decode-sequence check: all 121 layers in model order at M = 1, 4, 8, 16 with a small torch op
    between calls, against the sum of the per-shape best times (the overhead of dispatch and of
    switching thread pools).
Writes everything to bench/results/kernels.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from bench.common import best_of
from engine.kernels.autotune import select_kernels
from engine.layers.linear import Linear

HIDDEN, LAYERS = 576, 30
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
LM_HEAD = (576, 49152)
M_VALUES = (1, 2, 4, 8, 16, 32, 64, 256)
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
    return out


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


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


def best_ms(fn: Callable[[], object], seconds: float = 0.1) -> float:
    """Milliseconds of `fn`'s fastest call, after a warm-up call, over at least `seconds` and 3
    calls."""
    return best_of(fn, 3, seconds=seconds, warmup=True) * 1e3


def layout_check(ms: tuple[int, ...]) -> list[dict[str, object]]:
    """OpenBLAS / oneDNN per-call ms on W^T [in, out] vs W [out, in] (one warm matrix each)."""
    rows = []
    op = torch.ops.mkldnn._linear_pointwise
    for k, n in [*SHAPES.values(), LM_HEAD]:
        w = torch.randn(n, k) * k**-0.5  # [out, in]
        wt = w.t().contiguous()  # [in, out]
        for m in ms:
            x = torch.randn(m, k)
            xn, out = x.numpy(), np.empty((m, n), np.float32)
            row: dict[str, object] = {"shape": [k, n], "m": m}
            for key, fn in {
                "openblas_in_out": partial(np.matmul, xn, wt.numpy(), out=out),
                "openblas_out_in": partial(np.matmul, xn, w.numpy().T, out=out),
                "onednn_in_out": partial(op, x, wt.t(), None, "none", [], ""),
                "onednn_out_in": partial(op, x, w, None, "none", [], ""),
            }.items():
                row[key] = best_ms(fn)
            rows.append(row)
    return rows


def sequence_check(model: list[Linear], best: dict[tuple[int, int, int], float], m: int) -> dict:
    """All layers in model order, as a decode step calls them: bare, and with a small torch op
    (like a norm or an activation) before each call; against the sum of per-shape best times."""
    xs = {k: torch.randn(m, k) for k in {ly.in_features for ly in model}}
    ins = [xs[ly.in_features] for ly in model]

    def bare() -> None:
        for layer, x in zip(model, ins, strict=True):
            layer(x)

    def with_ops() -> None:
        for layer, x in zip(model, ins, strict=True):
            layer(x * 1.0001)

    total = sum(best[(ly.in_features, ly.out_features, m)] for ly in model)
    bare_ms, ops_ms = best_ms(bare, seconds=1.0), best_ms(with_ops, seconds=1.0)
    return {"m": m, "bare_ms": bare_ms, "with_ops_ms": ops_ms, "sum_of_best_ms": total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--target-ms", type=float, default=20.0, help="time per kernel per round")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args()

    torch.manual_seed(0)
    model = build_model(args.layers)
    ticks0 = cpu_ticks()
    with torch.inference_mode():
        t0 = time.perf_counter()
        quick = select_kernels(model, M_VALUES[:-1])  # what a server does at start-up
        quick_s = time.perf_counter() - t0
        table = select_kernels(
            model, M_VALUES, rounds=args.rounds, target_s=args.target_ms / 1e3, prune=1e9
        )
        print(f"threads={table.threads}  selection: default {quick_s:.2f}s, ", end="")
        print(f"this table {table.seconds:.1f}s")
        print("ms per call (GB/s of weights); * = chosen")
        print(table.format())
        layout = layout_check((1, 4, 16))
        print("\nstorage layout, ms per call: W^T [in,out] (stored) vs W [out,in]")
        for r in layout:
            print(
                f"{r['shape']} M={r['m']:<3} openblas {r['openblas_in_out']:.3f} vs "
                f"{r['openblas_out_in']:.3f}   onednn {r['onednn_in_out']:.3f} vs "
                f"{r['onednn_out_in']:.3f}"
            )
        best = {}
        for t in table.timings:
            if t.exact and table.chosen[t.shape][t.m] == t.kernel:
                best[(*t.shape, t.m)] = t.ms
        seq = [sequence_check(model, best, m) for m in (1, 4, 8, 16)]
        print("\ndecode sequence (all layers in model order, chosen kernels), ms per pass")
        for s in seq:
            print(
                f"M={s['m']:<3} bare {s['bare_ms']:.2f}  with a torch op per call "
                f"{s['with_ops_ms']:.2f}  sum of per-shape best {s['sum_of_best_ms']:.2f}"
            )

    ticks = [b - a for a, b in zip(ticks0, cpu_ticks(), strict=True)]
    other = (ticks[1] - ticks[2]) / max(ticks[0], 1)  # CPU share used by other processes
    print(f"other processes used {other:.0%} of the CPUs during the run", end="")
    print(" (timings are contended: rerun on an idle machine)" if other > 0.05 else "")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    result = {
        "machine": {
            "cpu": cpu_name(),
            "cores": os.cpu_count(),
            "torch_threads": table.threads,
            "torch": torch.__version__,
            "numpy": np.__version__,
        },
        "other_processes_cpu_share": other,
        "default_selection_s": quick_s,
        "default_selection": {f"{k}x{n}": c for (k, n), c in quick.chosen.items()},
        "chosen": {f"{k}x{n}": c for (k, n), c in table.chosen.items()},
        "timings": [
            {
                k: (v if not isinstance(v, float) or math.isfinite(v) else None)
                for k, v in vars(t).items()
            }
            for t in table.timings
        ],
        "layout": layout,
        "sequence": seq,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
