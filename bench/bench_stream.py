"""How fast the rows kernel streams weights from memory at 1 to `max_rows` rows, on one core and
on all of them: `python -m bench.bench_stream`.

A verify step's products read every weight once for all its rows, so they cost what one row's
do only where the cores stream the weights as fast with several rows' arithmetic as with one
row's. This measures that directly: one product over a packed matrix far larger than the caches
(k = 576, 256 MiB by default, on huge pages as the engine packs them), for each thread count, row
count and, from 2 rows, each prefetch mode, all called in turn in every round (so that a slow
spell of a shared host hits all alike). Rounds are split by the 1-row time at the most threads
into a fast and a slow half; each figure is the half's median GB/s and, in brackets, the median
over its rounds of the time over that round's 1-row time at the same thread count.
Writes bench/results/stream.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics

import torch

from bench.bench_kernels import cpu_name
from bench.common import interleaved_rounds
from engine.kernels.rows import PREFETCH_MODES, load_rows_gemm

RESULTS = os.path.join(os.path.dirname(__file__), "results", "stream.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="weight bytes streamed per product")
    ap.add_argument("--k", type=int, default=576, help="input features")
    ap.add_argument("--rows", type=int, nargs="+", default=None, help="default: 1..max_rows")
    ap.add_argument("--threads", type=int, nargs="+", default=None, help="default: 1 and all")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args()
    lib = load_rows_gemm()
    if lib is None:
        raise SystemExit("rows_gemm could not be built on this host")
    torch.manual_seed(0)
    n = max(args.mib * 2**20 // (4 * args.k) // lib.PANEL, 1) * lib.PANEL  # output features
    packed = lib.pack(torch.randn(args.k, n) * args.k**-0.5)  # [n / 16, k, 16]
    rows = sorted({1, *(args.rows or range(1, lib.max_rows + 1))})  # 1 row: the reference
    saved_threads = lib.threads
    threads = args.threads or sorted({1, torch.get_num_threads()})
    inputs = {m: torch.randn(m, args.k) for m in rows}
    outputs = {m: torch.empty(m, n) for m in rows}

    def product(t: int, m: int, mode: str) -> None:
        lib.set_threads(t)
        if m > 1:
            lib.set_prefetch(mode, m)
        lib.matmul(inputs[m], packed, n, out=outputs[m])

    # (threads, rows, prefetch mode): one row always streams without software prefetch
    cases = [
        (t, m, mode)
        for t in threads
        for m in rows
        for mode in (PREFETCH_MODES if m > 1 else ("none",))
    ]
    saved = {m: lib.prefetch(m) for m in rows if m > 1}
    try:
        rounds = interleaved_rounds(
            {str(c): functools.partial(product, *c) for c in cases}, args.rounds
        )
    finally:
        lib.set_threads(saved_threads)
        for m, mode in saved.items():
            lib.set_prefetch(mode, m)
    times = {c: rounds[str(c)] for c in cases}  # seconds per round
    gbytes = packed.numel() * 4 / 1e9
    pivot = times[(max(threads), 1, "none")]
    order = sorted(range(args.rounds), key=pivot.__getitem__)
    halves = {"fast": order[: (args.rounds + 1) // 2], "slow": order[(args.rounds + 1) // 2 :]}
    print(
        f"{cpu_name()}, rows kernel ({lib.isa}); {gbytes * 1e3:.0f} MB of weights, k = {args.k}; "
        f"{args.rounds} rounds; GB/s (time over the 1-row time in the same round)"
    )
    result: dict[str, object] = {"cpu": cpu_name(), "isa": lib.isa, "mb": gbytes * 1e3}
    for half, picked in halves.items():
        if not picked:
            continue
        lo, hi = min(pivot[i] for i in picked), max(pivot[i] for i in picked)
        print(
            f"{half} half: {len(picked)} rounds, 1 row on {max(threads)} threads "
            f"{lo * 1e3:.2f}-{hi * 1e3:.2f} ms"
        )
        table = {
            (t, m, mode): (
                gbytes / statistics.median(ts[i] for i in picked),
                statistics.median(ts[i] / times[(t, 1, "none")][i] for i in picked),
            )
            for (t, m, mode), ts in times.items()
        }
        print(f"  {'threads':>7} {'rows':>4}" + "".join(f"{mode:>15}" for mode in PREFETCH_MODES))
        for t in threads:
            for m in rows:
                cells = [table.get((t, m, mode)) for mode in PREFETCH_MODES]
                print(
                    f"  {t:>7} {m:>4}"
                    + "".join(
                        " " * 15 if cell is None else f"{cell[0]:>7.1f} ({cell[1]:.3f})"
                        for cell in cells
                    )
                )
        result[half] = [
            {"threads": t, "rows": m, "prefetch": mode, "gb_s": rate, "ratio": ratio}
            for (t, m, mode), (rate, ratio) in table.items()
        ]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
