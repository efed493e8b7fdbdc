"""Serving throughput and latency through gRPC: streaming clients against the real server.

Starts `python -m server.main` on SmolLM2 (float32, the server's defaults otherwise) and, for each
concurrency level, runs that many clients; each sends GenerateStream requests back to back for
`--duration` seconds: greedy, exactly `--new-tokens` tokens (max_new_tokens = min_new_tokens),
on held-out chat prompts (bench/chat_prompts.py) in the model's chat template. Per level:
aggregate generated tokens/s (tokens that arrived within the measurement windows over their
length; requests in flight at a window's end finish outside it), time to first token (send
to the first message with a generated token), inter-token latency (gaps between token messages,
split evenly over the tokens a message adds) and time per output token per request. The
acceptance ratios: aggregate tokens/s at the highest level over the lowest (target >= 8x) and
p50 inter-token latency at the highest over the lowest (target <= 4x). Prints a table and writes
JSON (bench/results/serving.json, or serving_speculator.json with a speculator), with the 1-minute
load average before and after each level: on a shared machine, other work skews the numbers.

`--variant NAME KEY=VALUE...` (repeatable) starts another server beside the first, its
environment changed by the settings (e.g. `--variant int8 QUANTIZE=int8`), and `--peer ADDRESS`
adds a TGIS-compatible gRPC server already running (e.g. vLLM's CPU build through
vllm-tgis-adapter, started by bench/peer_vllm.sh; `--peer-name` names it): every target takes
its turn in the same windows (below) with the same clients, prompts and token counts, and per
level the table gives each one's tokens/s and the ratios of every variant and the peer over the
first server and of every variant over the peer, with a warning where a target's requests did not
all generate `--new-tokens` tokens (bench/results/serving_compare.json).

`--speculator PATH` runs two servers side by side, speculation off (SPECULATOR_PATH and
SPECULATOR_NAME removed from the server's env) and on (SPECULATOR_PATH=PATH, the server's
adaptive policy deciding per step), each level's time split into `--rounds` windows per server
taken in turns (off, on, on, off, off, on, ...), so that both see the same host; it adds per
level the ratio of on to off, the mean tokens per speculative step and the acceptance per head
(from the server's tgi_spec_* counters); at the lowest level T (tokens per speculative step), C
(a speculative step's time over the off server's decode step), the predicted speedup T/C and
the realised one; and a PNG plot of tokens/s and p50 inter-token latency
(bench/results/serving_speculator.{json,png}; the plot needs matplotlib:
`pip install -e '.[bench]'`).

    python -m bench.bench_serving [--concurrency 1 4 16 32] [--duration 30] [--rounds 3]
                                  [--speculator PATH] [--variant NAME KEY=VALUE...]
                                  [--peer ADDRESS [--peer-name NAME]]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from transformers import AutoTokenizer

from bench.chat_prompts import SERVING_PROMPTS
from engine.paths import default_model_path
from server.pb import generation_pb2 as pb
from server.pb import generation_pb2_grpc
from tools.server_process import ServerProcess
from training.prompts import chat_texts

RESULTS = Path(__file__).parent / "results"
TARGET_THROUGHPUT_RATIO = 8.0
TARGET_ITL_RATIO = 4.0


@dataclass(frozen=True)
class Record:
    """One request: when it was sent, when each token message arrived, tokens generated."""

    sent: float
    arrivals: list[tuple[float, int]]  # (time, generated_token_count) per token message
    tokens: int


def percentile(values: list[float], q: float) -> float:
    """The `q`-th percentile (0..100), linear between closest ranks; NaN when empty."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


async def client(
    stub: generation_pb2_grpc.GenerationServiceStub,
    prompts: list[str],
    first: int,
    stride: int,
    new_tokens: int,
    deadline: float,
    records: list[Record],
) -> None:
    """Send requests back to back until `deadline`, prompts `first`, `first + stride`, ..."""
    i = first
    while time.perf_counter() < deadline:
        request = pb.SingleGenerationRequest(
            request=pb.GenerationRequest(text=prompts[i % len(prompts)]),
            params=pb.Parameters(
                method=pb.GREEDY,
                stopping=pb.StoppingCriteria(max_new_tokens=new_tokens, min_new_tokens=new_tokens),
            ),
        )
        sent = time.perf_counter()
        arrivals = []
        async for message in stub.GenerateStream(request, timeout=600):
            if message.generated_token_count:
                arrivals.append((time.perf_counter(), message.generated_token_count))
        records.append(Record(sent, arrivals, arrivals[-1][1] if arrivals else 0))
        i += stride


async def run_window(
    target: str, prompts: list[str], concurrency: int, new_tokens: int, duration: float
) -> tuple[list[Record], int]:
    """`concurrency` clients for `duration` seconds: their records, and the tokens that arrived
    within the window. Requests in flight at its end run to completion (their records count for
    latency) before the call returns."""
    records: list[Record] = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        deadline = time.perf_counter() + duration
        await asyncio.gather(
            *(
                client(stub, prompts, c, concurrency, new_tokens, deadline, records)
                for c in range(concurrency)
            )
        )
    in_window = 0
    for r in records:
        in_window += max((n for t, n in r.arrivals if t <= deadline), default=0)
    return records, in_window


def summarize(
    concurrency: int, records: list[Record], window_tokens: int, window_s: float
) -> dict[str, Any]:
    """One level's row of results: throughput from the tokens that arrived within `window_s`
    seconds of windows (so that each window's drain, where fewer clients remain, does not count),
    latencies from every request."""
    tokens = sum(r.tokens for r in records)
    ttft = [r.arrivals[0][0] - r.sent for r in records if r.arrivals]
    itl: list[float] = []
    tpot: list[float] = []
    for r in records:
        for (t0, n0), (t1, n1) in zip(r.arrivals, r.arrivals[1:], strict=False):
            itl += [(t1 - t0) / (n1 - n0)] * (n1 - n0)
        if r.tokens > 1:
            tpot.append((r.arrivals[-1][0] - r.arrivals[0][0]) / (r.tokens - r.arrivals[0][1]))
    return {
        "concurrency": concurrency,
        "requests": len(records),
        "tokens": tokens,
        "window_s": window_s,
        "tokens_per_s": window_tokens / window_s,
        "ttft_p50_ms": 1000 * percentile(ttft, 50),
        "ttft_p90_ms": 1000 * percentile(ttft, 90),
        "itl_p50_ms": 1000 * percentile(itl, 50),
        "itl_p90_ms": 1000 * percentile(itl, 90),
        "tpot_p50_ms": 1000 * percentile(tpot, 50),
    }


def print_table(rows: list[dict[str, Any]], header: bool = True) -> None:
    title = (
        f"{'conc':>5} {'reqs':>5} {'tokens':>7} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p90':>9} "
        f"{'ITL p50':>8} {'ITL p90':>8} {'TPOT p50':>9}"
    )
    if header:
        print(title)
        print("-" * len(title))
    for r in rows:
        print(
            f"{r['concurrency']:>5} {r['requests']:>5} {r['tokens']:>7} {r['tokens_per_s']:>8.1f} "
            f"{r['ttft_p50_ms']:>7.0f}ms {r['ttft_p90_ms']:>7.0f}ms {r['itl_p50_ms']:>6.1f}ms "
            f"{r['itl_p90_ms']:>6.1f}ms {r['tpot_p50_ms']:>7.1f}ms"
        )


_STEP_TIME = 'tgi_batch_inference_forward_duration_{}{{makeup="single_only",method="next_token"}}'


def spec_counters(server: ServerProcess) -> dict[str, float]:
    """The server's speculation counters (every `tgi_spec_*` sample by name with its labels
    but the decoding method, summed over methods) and the sum and count of its decode step
    times."""
    out: dict[str, float] = {}
    wanted = (_STEP_TIME.format("sum"), _STEP_TIME.format("count"))
    for line in server.metrics_text().splitlines():
        if line.startswith("tgi_spec_") or line.startswith(wanted):
            name, value = line.rsplit(" ", 1)
            name = re.sub(r',?method="[^"]*"', "", name).replace("{,", "{").replace("{}", "")
            out[name] = out.get(name, 0.0) + float(value)
    return out


def step_ms(before: dict[str, float], after: dict[str, float], histogram: str) -> float | None:
    """The mean of a duration histogram's samples between two `spec_counters` readings, in
    milliseconds (None without samples); `histogram` is its name with a `{}` for the suffix."""
    count = after.get(histogram.format("count"), 0.0) - before.get(histogram.format("count"), 0.0)
    total = after.get(histogram.format("sum"), 0.0) - before.get(histogram.format("sum"), 0.0)
    return 1000 * total / count if count else None


def spec_stats(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Speculative steps, mean tokens per speculative step and acceptance per head between two
    `spec_counters` readings."""

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    steps = delta("tgi_spec_tokens_per_step_count")
    acceptance = []
    for head in range(16):
        proposed = delta(f'tgi_spec_head_proposed_total{{head="{head}"}}')
        if proposed <= 0:
            break
        acceptance.append(delta(f'tgi_spec_head_accepted_total{{head="{head}"}}') / proposed)
    return {
        "spec_steps": int(steps),
        "tokens_per_spec_step": delta("tgi_spec_tokens_per_step_sum") / steps if steps else None,
        "head_acceptance": acceptance,
        "spec_step_ms": step_ms(before, after, "tgi_spec_step_duration_{}"),
    }


def sweep(
    model: Path,
    configs: dict[str, tuple[dict[str, str], tuple[str, ...]]],
    prompts: list[str],
    levels: list[int],
    new_tokens: int,
    duration: float,
    rounds: int,
    peers: dict[str, str] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """Start one server per config (name -> (env, env vars to unset)), all at once, and run
    every concurrency level against each and against each peer (name -> gRPC address of a
    TGIS-compatible server already running): an uncounted 2-second window each, then `rounds`
    windows of `duration / rounds` seconds per target, the targets taking turns in an order
    that reverses every round (A B C, C B A, A B C, ...), so that a slow spell of a shared host
    and the cost of going first hit all of them alike. One row per level and target (for the
    servers started here with the decode step time, and `spec_stats` when one speculates)."""
    peers = peers or {}
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in [*configs, *peers]}
    with contextlib.ExitStack() as stack:
        servers = {
            name: stack.enter_context(
                ServerProcess(
                    model, env, Path(f"/tmp/specserve-bench-{name}-{os.getpid()}.log"), unset=unset
                )
            )
            for name, (env, unset) in configs.items()
        }
        targets = {name: server.grpc_target for name, server in servers.items()} | peers
        for target in targets.values():  # warm-up
            asyncio.run(run_window(target, prompts, 2, new_tokens, 0.1))
        for concurrency in levels:
            records: dict[str, list[Record]] = {name: [] for name in targets}
            window_tokens = dict.fromkeys(targets, 0)
            before = {name: spec_counters(server) for name, server in servers.items()}
            load_before = os.getloadavg()[0]
            for target in targets.values():  # uncounted: the level's first steps
                asyncio.run(run_window(target, prompts, concurrency, new_tokens, 2.0))
            for r in range(rounds):
                turns = list(targets.items())
                for name, target in turns[::-1] if r % 2 else turns:
                    window = asyncio.run(
                        run_window(target, prompts, concurrency, new_tokens, duration / rounds)
                    )
                    records[name] += window[0]
                    window_tokens[name] += window[1]
            for name in targets:
                row = summarize(concurrency, records[name], window_tokens[name], duration)
                row["loadavg_1m"] = [load_before, os.getloadavg()[0]]
                row["requests_not_new_tokens"] = sum(r.tokens != new_tokens for r in records[name])
                if name in servers:
                    after = spec_counters(servers[name])
                    row["decode_step_ms"] = step_ms(before[name], after, _STEP_TIME)
                    if "SPECULATOR_PATH" in configs[name][0]:
                        row.update(spec_stats(before[name], after))
                rows[name].append(row)
                print(
                    f"{name}: {concurrency} clients, {row['tokens_per_s']:.1f} tok/s, "
                    f"ITL p50 {row['itl_p50_ms']:.1f} ms",
                    flush=True,
                )
    return rows


def compare(
    results: dict[str, list[dict[str, Any]]],
    base: str,
    variants: list[str],
    peers: list[str],
    new_tokens: int,
) -> list[dict[str, Any]]:
    """Per level, each target's tokens/s and the ratios that compare them: every variant and peer
    over `base`, and every variant over every peer. Prints them, and a warning for a target
    whose requests did not all generate `new_tokens` tokens (its tokens/s then measures other
    work). One dict of ratios per level."""
    names = [base, *variants, *peers]
    out = []
    for i, level in enumerate(r["concurrency"] for r in results[base]):
        row = {name: results[name][i] for name in names}
        tps = {name: r["tokens_per_s"] for name, r in row.items()}
        pairs = [(n, base) for n in [*variants, *peers]] + [(v, p) for v in variants for p in peers]
        ratios = {f"{a}/{b}": tps[a] / tps[b] if tps[b] else float("nan") for a, b in pairs}
        print(f"\n{level} clients:")
        for name in names:
            r = row[name]
            print(
                f"  {name:>16}: {r['tokens_per_s']:8.1f} tok/s, ITL p50 {r['itl_p50_ms']:6.1f} ms, "
                f"TTFT p50 {r['ttft_p50_ms']:6.0f} ms, {r['requests']} requests"
            )
            if r["requests_not_new_tokens"]:
                print(
                    f"  warning: {r['requests_not_new_tokens']} of {name}'s requests did not "
                    f"generate {new_tokens} tokens ({r['tokens']} in {r['requests']} requests)"
                )
        print("  " + ", ".join(f"{k} {v:.3f}x" for k, v in ratios.items()))
        out.append({"concurrency": level, **ratios})
    return out


def plot(off: list[dict[str, Any]], on: list[dict[str, Any]], path: Path) -> bool:
    """Tokens/s and p50 inter-token latency against concurrency, speculation off and on, as a
    PNG at `path`; False (nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for rows, label in ((off, "speculation off"), (on, "speculation on")):
        levels = [r["concurrency"] for r in rows]
        left.plot(levels, [r["tokens_per_s"] for r in rows], marker="o", label=label)
        right.plot(levels, [r["itl_p50_ms"] for r in rows], marker="o", label=label)
    for ax, title in ((left, "aggregate tokens/s"), (right, "p50 inter-token latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streaming clients")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("specserve through gRPC: SmolLM2-135M-Instruct, float32, 2 CPU cores")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=default_model_path())
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--duration", type=float, default=30.0, help="seconds per level")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--speculator", type=Path, help="serve with SPECULATOR_PATH=PATH")
    parser.add_argument(
        "--rounds",
        type=int,
        help="windows per level and server, taken in turns (default: 1, or 4 with --speculator)",
    )
    parser.add_argument(
        "--server-env",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="extra server environment, e.g. MAX_BATCH_SIZE=32",
    )
    parser.add_argument(
        "--variant",
        nargs="+",
        action="append",
        default=[],
        metavar=("NAME", "KEY=VALUE"),
        help="another server beside the first, its environment changed by KEY=VALUE..., e.g. "
        "--variant int8 QUANTIZE=int8 (repeatable)",
    )
    parser.add_argument(
        "--peer",
        metavar="ADDRESS",
        help="a TGIS-compatible gRPC server already running (host:port), taking turns too",
    )
    parser.add_argument("--peer-name", default="peer", help="the peer's name in the results")
    parser.add_argument("--out", type=Path, help="JSON output (default: bench/results/...)")
    args = parser.parse_args()

    prompts = chat_texts(AutoTokenizer.from_pretrained(str(args.model)), SERVING_PROMPTS)
    env = {"DTYPE_STR": "float32"}
    env.update(kv.split("=", 1) for kv in args.server_env)
    base = "off" if args.speculator is not None else env["DTYPE_STR"]
    configs = {base: (env, ("SPECULATOR_PATH", "SPECULATOR_NAME"))}
    if args.speculator is not None:
        configs["on"] = ({**env, "SPECULATOR_PATH": str(args.speculator.resolve())}, ())
    peers = {args.peer_name: args.peer} if args.peer else {}
    names = [name for name, *_ in args.variant] + list(peers)
    if len(set(names)) < len(names) or {base, "on"} & set(names):
        parser.error(f"variant and peer names must differ, and from {base!r} and 'on': {names}")
    if any("=" not in kv for _, *kvs in args.variant for kv in kvs):
        parser.error("a variant is a name followed by KEY=VALUE settings")
    variants = {name: dict(kv.split("=", 1) for kv in kvs) for name, *kvs in args.variant}
    for name, extra in variants.items():
        unset = () if "SPECULATOR_PATH" in extra else ("SPECULATOR_PATH", "SPECULATOR_NAME")
        configs[name] = ({**env, **extra}, unset)
    levels = list(args.concurrency)
    rounds = args.rounds or (4 if args.speculator is not None else 1)
    results = sweep(
        args.model, configs, prompts, levels, args.new_tokens, args.duration, rounds, peers
    )
    rows, spec_rows = results[base], results.get("on", [])
    for off, on in zip(rows, spec_rows, strict=False):  # no speculator: spec_rows is empty
        on["speedup_vs_off"] = on["tokens_per_s"] / off["tokens_per_s"]
    lo, hi = rows[0], rows[-1]
    throughput_ratio = hi["tokens_per_s"] / lo["tokens_per_s"]
    itl_ratio = hi["itl_p50_ms"] / lo["itl_p50_ms"]
    print()
    print_table(rows)
    print(
        f"\naggregate tok/s at {hi['concurrency']} vs {lo['concurrency']}: {throughput_ratio:.2f}x "
        f"(target >= {TARGET_THROUGHPUT_RATIO:g}x)\n"
        f"p50 ITL at {hi['concurrency']} vs {lo['concurrency']}: {itl_ratio:.2f}x "
        f"(target <= {TARGET_ITL_RATIO:g}x)"
    )
    if spec_rows:
        print("\nspeculation on:")
        print_table(spec_rows)
        for r in spec_rows:
            tps = r["tokens_per_spec_step"]
            heads = " ".join(f"{a:.2f}" for a in r["head_acceptance"])
            print(
                f"  {r['concurrency']:>3} clients: {r['speedup_vs_off']:.3f}x of off, "
                f"{r['spec_steps']} speculative steps"
                + (f", {tps:.2f} tokens/step, acceptance per head {heads}" if tps else "")
            )
        first_off, first_on = rows[0], spec_rows[0]
        if first_on["spec_step_ms"] and first_off["decode_step_ms"]:
            t = first_on["tokens_per_spec_step"]
            c = first_on["spec_step_ms"] / first_off["decode_step_ms"]
            first_on["prediction"] = {"T": t, "C": c, "predicted": t / c, "gpu_predicted": t}
            print(
                f"\nat {first_on['concurrency']} client(s): T = {t:.3f} tokens per speculative "
                f"step, C = {first_on['spec_step_ms']:.1f} / {first_off['decode_step_ms']:.1f} ms "
                f"= {c:.3f} (speculative step, drafting included, over the off server's decode "
                f"step), predicted T/C = {t / c:.3f}x, realised {first_on['speedup_vs_off']:.3f}x "
                f"({first_on['speedup_vs_off'] / (t / c):.0%} of predicted); "
                f"on a GPU, where C is about 1: {t:.2f}x"
            )
    comparison: list[dict[str, Any]] = []
    if variants or peers:
        print(f"\n{base} against {', '.join([*variants, *peers])}:")
        comparison = compare(results, base, list(variants), list(peers), args.new_tokens)
    name = "serving_speculator" if spec_rows else "serving"
    if comparison:
        name = "serving_compare"
    out = args.out or RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "model": args.model.name,
                "dtype": env["DTYPE_STR"],
                "speculator": str(args.speculator) if args.speculator is not None else None,
                "server_env": env,
                "new_tokens": args.new_tokens,
                "duration_s": args.duration,
                "rounds": rounds,
                "machine": {"cpus": os.cpu_count(), "processor": platform.processor()},
                "rows": rows,
                "speculator_rows": spec_rows,
                "variants": {
                    n: {"server_env": configs[n][0], "rows": results[n]} for n in variants
                },
                "peers": {n: {"address": a, "rows": results[n]} for n, a in peers.items()},
                "comparison": comparison,
                "throughput_ratio": throughput_ratio,
                "itl_p50_ratio": itl_ratio,
                "targets": {
                    "throughput_ratio_min": TARGET_THROUGHPUT_RATIO,
                    "itl_p50_ratio_max": TARGET_ITL_RATIO,
                },
            },
            indent=2,
        )
        + "\n"
    )
    if spec_rows:
        png = out.with_suffix(".png")
        print(f"wrote {png}" if plot(rows, spec_rows, png) else "no plot: matplotlib missing")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
