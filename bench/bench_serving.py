"""Serving throughput and latency through gRPC: streaming clients against the real server.

Starts `python -m server.main` on SmolLM2 (float32, the server's defaults otherwise) and, for each
concurrency level, runs that many clients; each sends GenerateStream requests back to back for
`--duration` seconds: greedy, exactly `--new-tokens` tokens (max_new_tokens = min_new_tokens),
on held-out chat prompts (bench/chat_prompts.py) in the model's chat template. Per level:
aggregate generated tokens/s (all tokens over the level's wall time), time to first token (send
to the first message with a generated token), inter-token latency (gaps between token messages,
split evenly over the tokens a message adds) and time per output token per request. The
acceptance ratios: aggregate tokens/s at the highest level over the lowest (target >= 8x) and
p50 inter-token latency at the highest over the lowest (target <= 4x). Prints a table and writes
JSON (bench/results/serving.json, or serving_speculator.json with a speculator), with the 1-minute
load average before and after each level: on a shared machine, other work skews the numbers.

`--speculator PATH` serves with SPECULATOR_PATH=PATH, for the same sweep with speculative
decoding on; without it SPECULATOR_PATH and SPECULATOR_NAME are removed from the server's env.

    python -m bench.bench_serving [--concurrency 1 4 16 32] [--duration 30] [--speculator PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
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


async def run_level(
    target: str, prompts: list[str], concurrency: int, new_tokens: int, duration: float
) -> dict[str, Any]:
    """One concurrency level; returns its row of results."""
    records: list[Record] = []
    load_before = os.getloadavg()[0]
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        start = time.perf_counter()
        deadline = start + duration
        await asyncio.gather(
            *(
                client(stub, prompts, c, concurrency, new_tokens, deadline, records)
                for c in range(concurrency)
            )
        )
        wall = time.perf_counter() - start
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
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft_p50_ms": 1000 * percentile(ttft, 50),
        "ttft_p90_ms": 1000 * percentile(ttft, 90),
        "itl_p50_ms": 1000 * percentile(itl, 50),
        "itl_p90_ms": 1000 * percentile(itl, 90),
        "tpot_p50_ms": 1000 * percentile(tpot, 50),
        "loadavg_1m": [load_before, os.getloadavg()[0]],
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=default_model_path())
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--duration", type=float, default=30.0, help="seconds per level")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--speculator", type=Path, help="serve with SPECULATOR_PATH=PATH")
    parser.add_argument(
        "--server-env",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="extra server environment, e.g. MAX_BATCH_SIZE=32",
    )
    parser.add_argument("--out", type=Path, help="JSON output (default: bench/results/...)")
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    prompts = [
        str(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
            )
        )
        for p in SERVING_PROMPTS
    ]
    env = {"DTYPE_STR": "float32"}
    env.update(kv.split("=", 1) for kv in args.server_env)
    unset: tuple[str, ...] = ("SPECULATOR_PATH", "SPECULATOR_NAME")
    if args.speculator is not None:
        env["SPECULATOR_PATH"] = str(args.speculator.resolve())
        unset = ()
    log = Path(f"/tmp/specserve-bench-serving-{os.getpid()}.log")
    with ServerProcess(args.model, env, log, unset=unset) as server:
        asyncio.run(run_level(server.grpc_target, prompts, 2, args.new_tokens, 0.1))  # warm-up
        rows = []
        for concurrency in args.concurrency:
            rows.append(
                asyncio.run(
                    run_level(
                        server.grpc_target, prompts, concurrency, args.new_tokens, args.duration
                    )
                )
            )
            print_table(rows[-1:], header=len(rows) == 1)
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
    out = args.out or RESULTS / (
        "serving_speculator.json" if args.speculator is not None else "serving.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "model": args.model.name,
                "dtype": "float32",
                "speculator": str(args.speculator) if args.speculator is not None else None,
                "server_env": env,
                "new_tokens": args.new_tokens,
                "duration_s": args.duration,
                "machine": {"cpus": os.cpu_count(), "processor": platform.processor()},
                "rows": rows,
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
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
