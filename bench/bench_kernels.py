"""Linear-kernel benchmark for SmolLM2-135M's shapes: `python -m bench.bench_kernels`.

Builds the model's 121 fp32 linears (30 layers x {qkv, o, gate_up, down} + lm_head) with random
weights so every timed call reads cold weights as in a real decode step, runs `select_kernels`
with all kernels timed (no pruning), prints ms per call and GB/s per kernel, shape and M (the chosen
kernel marked *), then
  * a storage-layout check: OpenBLAS and oneDNN on W^T [in, out] (what Linear stores) against a
    contiguous W [out, in];
  * a decode-sequence check: all 121 layers in model order at M = 1, 4, 16 with a small torch op
    between calls, against the sum of the per-shape best times (the overhead of dispatch and of
    switching thread pools).
Writes everything to bench/results/kernels.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable

import numpy as np
import torch

from engine.layers.linear import Linear, select_kernels

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


def best_ms(fn: Callable[[], object], seconds: float = 0.1) -> float:
    fn()
    times = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(times) < 3:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


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
            row["openblas_in_out"] = best_ms(lambda: np.matmul(xn, wt.numpy(), out=out))
            row["openblas_out_in"] = best_ms(lambda: np.matmul(xn, w.numpy().T, out=out))
            row["onednn_in_out"] = best_ms(lambda: op(x, wt.t(), None, "none", [], ""))
            row["onednn_out_in"] = best_ms(lambda: op(x, w, None, "none", [], ""))
            rows.append(row)
    return rows


def sequence_check(model: list[Linear], best: dict[tuple[int, int, int], float], m: int) -> dict:
    """One pass over all layers in model order, as a decode step would call them."""
    xs = {k: torch.randn(m, k) for k in {ly.in_features for ly in model}}

    def step() -> None:
        for layer in model:
            x = xs[layer.in_features]
            y = layer(x * 1.0001)  # a small torch op between calls, like norms/activations
            del y

    ms = best_ms(step, seconds=1.0)
    bare = sum(best[(ly.in_features, ly.out_features, m)] for ly in model)
    return {"m": m, "sequence_ms": ms, "sum_of_best_ms": bare, "ratio": ms / bare}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--target-ms", type=float, default=20.0, help="time per kernel per round")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args()

    torch.manual_seed(0)
    model = build_model(args.layers)
    with torch.inference_mode():
        t0 = time.perf_counter()
        quick = select_kernels(model, M_VALUES[:-1])  # what a server does at start-up
        quick_s = time.perf_counter() - t0
        table = select_kernels(
            model, M_VALUES, rounds=args.rounds, target_s=args.target_ms / 1e3, prune=1e9
        )
        print(f"threads={table.threads}  selection: default {quick_s:.2f}s, bench {table.seconds:.1f}s")
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
        seq = [sequence_check(model, best, m) for m in (1, 4, 16)]
        print("\ndecode sequence (all layers in model order), chosen kernels")
        for s in seq:
            print(
                f"M={s['m']:<3} {s['sequence_ms']:.2f} ms vs sum of best {s['sum_of_best_ms']:.2f}"
                f" ms: ratio {s['ratio']:.2f}"
            )

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    result = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "torch_threads": table.threads,
            "torch": torch.__version__,
            "numpy": np.__version__,
        },
        "default_selection_s": quick_s,
        "default_selection": {f"{k}x{n}": c for (k, n), c in quick.chosen.items()},
        "chosen": {f"{k}x{n}": c for (k, n), c in table.chosen.items()},
        "timings": [vars(t) for t in table.timings],
        "layout": layout,
        "sequence": seq,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
