"""Quantized CPU kernels against float32 on the default model: `python -m bench.bench_quant`.

1. Per layer: each of SmolLM2-135M's linear shapes (30 layers' worth of random weights, so that
   a call streams them as a decode step does) at 1-32 rows (decode and verification trees) and
   at prefill sizes, timed as `bench.common.interleaved_rounds` does (candidates in turn within a
   round): ``F.linear`` and the float32 rows kernel on the
   float weights, `build_quant_kernel` on the same weights rounded to nearest into int8 per output
   channel (W8A8), 4 bits in groups of 64 (symmetric; 576 input features make no groups of 128)
   and of 32 (asymmetric, act-ordered), and at a prefill size the alternative of dequantising the
   weight and calling ``F.linear``. The fastest round of each (a busy shared host slows rounds,
   not the kernels).
2. Whole model: batch-1 greedy decode tokens/s of the engine in float32 and with every decoder
   linear replaced by the quantized kernels (round to nearest; a bench adapter, not a loader), the
   LM head in float32 and, for comparison only, in int8; in one process, alternating.

Writes bench/results/quant.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import best_of
from engine.kernels.quant_rows import build_quant_kernel
from engine.kernels.rows import load_rows_gemm
from engine.quant.weights import QuantizedWeight, pack_int4

LAYERS = 30
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
HEAD = (576, 49152)
ROWS = (1, 4, 8, 16, 32)
PREFILL_ROWS = (128,)
FORMATS: dict[str, tuple[int, int | None, bool, bool]] = {
    # name: (bits, group size (None: per channel), asymmetric, act-order)
    "int8": (8, None, False, False),
    "q4g64": (4, 64, False, False),
    "q4g32a": (4, 32, True, True),
}
RESULTS = Path(__file__).parent / "results" / "quant.json"


def quantize(w: torch.Tensor, fmt: str, seed: int = 0) -> QuantizedWeight:
    """Round-to-nearest `w` [out, in] into `FORMATS[fmt]` (act-order: a random permutation)."""
    bits, group, asym, act_order = FORMATS[fmt]
    out, k = w.shape
    gs = group or k
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if act_order else None
    ws = (w if perm is None else w[:, perm]).reshape(out, k // gs, gs)
    qmax = 2 ** (bits - 1) - 1
    if asym:
        lo, hi = ws.amin(dim=2), ws.amax(dim=2)
        scales = ((hi - lo) / (2**bits - 1)).clamp_min(1e-12)
        zeros = (torch.round(-lo / scales) - 2 ** (bits - 1)).clamp(-(2 ** (bits - 1)), qmax)
        q = torch.round(ws / scales[..., None]) + zeros[..., None]
        zq: torch.Tensor | None = zeros.to(torch.int8)
    else:
        scales = (ws.abs().amax(dim=2) / qmax).clamp_min(1e-12)
        q, zq = torch.round(ws / scales[..., None]), None
    q = q.clamp(-(2 ** (bits - 1)), qmax).to(torch.int8).reshape(out, k)
    qweight = q if bits == 8 else pack_int4(q)
    return QuantizedWeight(bits, gs, qweight, scales.to(torch.float32), zq, perm)


def dequant_linear(qw: QuantizedWeight) -> Callable[[torch.Tensor], torch.Tensor]:
    """The prefill alternative: dequantise at each call, then ``F.linear``."""
    return lambda x: F.linear(x, qw.dequantize())


def time_rounds(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Fastest seconds per call of each function, called in turn within each round."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: min(t) for name, t in times.items()}


def per_layer(rounds: int, row_counts: list[int], shapes: list[str]) -> list[dict[str, object]]:
    rows_lib = load_rows_gemm()
    assert rows_lib is not None
    results: list[dict[str, object]] = []
    for name, (k, n) in {**SHAPES, "head": HEAD}.items():
        if name not in shapes:
            continue
        layers = 1 if name == "head" else LAYERS
        ws = [torch.randn(n, k) * k**-0.5 for _ in range(layers)]
        cands: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {
            "F.linear": [lambda x, w=w: F.linear(x, w) for w in ws],
        }
        packed = [rows_lib.pack(w.t().contiguous()) for w in ws]
        cands["rows_f32"] = [lambda x, p=p, n=n: rows_lib.matmul(x, p, n) for p in packed]
        qws = {fmt: [quantize(w, fmt, i) for i, w in enumerate(ws)] for fmt in FORMATS}
        for fmt, qs in qws.items():
            cands[fmt] = [build_quant_kernel(q, None) for q in qs]
        for m in row_counts:
            if name == "head" and m > 32:
                continue
            x = torch.randn(m, k)
            fns: dict[str, Callable[[], object]] = {}
            for cand, kernels in cands.items():
                fns[cand] = lambda ks=kernels, x=x: [f(x) for f in ks]
            if m in PREFILL_ROWS:
                for fmt, qs in qws.items():
                    deq = [dequant_linear(q) for q in qs]
                    fns[f"{fmt}_dequant"] = lambda ks=deq, x=x: [f(x) for f in ks]
            med = time_rounds(fns, rounds)
            row = {"shape": name, "k": k, "n": n, "m": m}
            row.update({c: t / layers * 1e6 for c, t in med.items()})  # us per layer
            results.append(row)
            print(row_text(row), flush=True)
        del cands, packed, qws
    return results


def row_text(row: dict[str, object]) -> str:
    cells = [f"{row['shape']:>7} m={row['m']:<3}"]
    base = float(row["rows_f32"])  # type: ignore[arg-type]
    for c, v in row.items():
        if c in ("shape", "k", "n", "m"):
            continue
        cells.append(f"{c} {float(v):8.1f}us ({base / float(v):.2f}x)")  # type: ignore[arg-type]
    return " | ".join(cells)


def whole_model(new_tokens: int, prompts_n: int) -> dict[str, float]:
    from engine import LLM
    from engine.paths import default_model_path
    from training.prompts import CHAT_PROMPTS, chat_prompt_ids

    llm = LLM(default_model_path(), dtype="float32")
    prompts = chat_prompt_ids(llm.tokenizer, CHAT_PROMPTS)[:prompts_n]
    linears = llm.runner.model.linears()
    head = max(linears, key=lambda lin: lin.out_features)
    saved = {id(lin): (lin._by_m, lin._large, lin.kernel_names) for lin in linears}
    configs: dict[str, dict[int, Callable[[torch.Tensor], torch.Tensor]]] = {}
    for fmt in FORMATS:
        for head_q in (False, True):
            kernels = {}
            for i, lin in enumerate(linears):
                if lin is head and not head_q:
                    continue
                w = lin.weight_view().detach().to(torch.float32).contiguous()
                qw = quantize(w, "int8" if lin is head else fmt, i)
                kernels[id(lin)] = build_quant_kernel(qw, lin.bias)
            configs[f"{fmt}{'+int8 head' if head_q else ''}"] = kernels

    def use(kernels: dict[int, Callable[[torch.Tensor], torch.Tensor]] | None) -> None:
        for lin in linears:
            by_m, large, names = saved[id(lin)]
            lin._by_m, lin._large, lin.kernel_names = by_m, large, names
            if kernels and id(lin) in kernels:
                lin.install({1: ("quant", kernels[id(lin)])})

    def rate() -> float:
        run = lambda n: [llm.generate([p], n, ignore_eos=True) for p in prompts]  # noqa: E731
        run(2)
        t_full = best_of(lambda: run(new_tokens), 1)
        t_one = best_of(lambda: run(1), 2)
        return len(prompts) * (new_tokens - 1) / (t_full - t_one)

    rates: dict[str, list[float]] = {"float32": [], **{c: [] for c in configs}}
    for _ in range(2):
        for name in rates:
            use(configs.get(name))
            rates[name].append(rate())
            print(f"{name}: {rates[name][-1]:.1f} tok/s", flush=True)
    use(None)
    return {name: max(r) for name, r in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[*ROWS, *PREFILL_ROWS])
    parser.add_argument("--shapes", nargs="+", default=[*SHAPES, "head"])
    parser.add_argument("--skip-layers", action="store_true")
    parser.add_argument("--skip-model", action="store_true")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    load = os.getloadavg()
    print(f"threads {load_rows_gemm().threads}, load {load}")  # type: ignore[union-attr]
    out: dict[str, object] = {"load_before": load}
    if not args.skip_layers:
        out["per_layer_us"] = per_layer(args.rounds, args.rows, args.shapes)
    if not args.skip_model:
        out["decode_tok_s"] = whole_model(args.new_tokens, args.prompts)
    out["load_after"] = os.getloadavg()
    print(json.dumps(out.get("decode_tok_s", {}), indent=1), os.getloadavg())
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
