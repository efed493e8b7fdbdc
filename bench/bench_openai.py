"""HTTP (the OpenAI-compatible API) against gRPC on one server: aggregate generated tokens/s of
`--concurrency` streaming clients (default 32), each sending requests back to back.

Starts `python -m server.main` (SmolLM2 by default; `--model` names another) and alternates
`--rounds` windows of `--duration` seconds per API in turns (grpc, http, http, grpc, ...), so
that both see the same host. Every request is greedy, exactly `--new-tokens` tokens
(max = min tokens), on held-out chat prompts: through HTTP as a streamed chat completion (the
server applies the chat template), through gRPC as GenerateStream of the same prompt with the
template applied by the client. Both clients are as light as can be (grpc.aio's C core; raw
Server-Sent Events over asyncio streams, one keep-alive connection per client), so that the
figures are the server's. Tokens count when they arrive within a window (HTTP: one per content
chunk, the rest of the request's usage count at its last chunk). Prints tokens/s per
API, their ratio (the target is HTTP >= 0.9x gRPC) and the 1-minute load average before and
after, and writes bench/results/openai.json.

    python -m bench.bench_openai [--concurrency 32] [--duration 20] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import grpc
from transformers import AutoTokenizer

from bench.chat_prompts import SERVING_PROMPTS
from engine.paths import default_model_path
from server.pb import generation_pb2 as pb
from server.pb import generation_pb2_grpc
from tools.server_process import ServerProcess

RESULTS = Path(__file__).resolve().parent / "results" / "openai.json"
Arrivals = list[tuple[float, int]]  # (time, cumulative tokens) of one request


async def grpc_client(
    target: str, texts: list[str], first: int, stride: int, new: int, deadline: float
) -> list[Arrivals]:
    out = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        i = first
        while time.perf_counter() < deadline:
            request = pb.SingleGenerationRequest(
                request=pb.GenerationRequest(text=texts[i % len(texts)]),
                params=pb.Parameters(
                    method=pb.GREEDY,
                    stopping=pb.StoppingCriteria(max_new_tokens=new, min_new_tokens=new),
                ),
            )
            arrivals = []
            async for message in stub.GenerateStream(request, timeout=600):
                if message.generated_token_count:
                    arrivals.append((time.perf_counter(), message.generated_token_count))
            out.append(arrivals)
            i += stride
    return out


async def http_client(
    url: str,
    model: str,
    prompts: list[str],
    first: int,
    stride: int,
    new: int,
    deadline: float,
) -> list[Arrivals]:
    """Streamed chat completions back to back on one keep-alive connection, read as raw
    Server-Sent Events (a client as light as grpc.aio's C core, so that the figures are the
    server's)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    out = []
    i = first
    try:
        while time.perf_counter() < deadline:
            body = json.dumps(
                {
                    "model": model,
                    "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
                    "temperature": 0,
                    "max_tokens": new,
                    "min_tokens": new,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
            ).encode()
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
            )
            out.append(await _read_events(reader))
            i += stride
    finally:
        writer.close()
    return out


async def _read_events(reader: asyncio.StreamReader) -> Arrivals:
    """One chunked SSE response: (arrival, tokens so far) per content event, the last one
    corrected to the usage count."""
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"HTTP API answered {status!r}")
    while (await reader.readline()) not in (b"\r\n", b""):
        pass
    arrivals: Arrivals = []
    count = 0
    while True:
        size = int((await reader.readline()).strip(), 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
            return arrivals
        for line in data.split(b"\n"):
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if event["choices"] and event["choices"][0]["delta"].get("content"):
                count += 1
                arrivals.append((time.perf_counter(), count))
            if event.get("usage") and arrivals:
                arrivals[-1] = (arrivals[-1][0], event["usage"]["completion_tokens"])


async def window(
    api: str, server: ServerProcess, model: str, prompts: list[str], texts: list[str], args: Any
) -> float:
    """Tokens/s of one window of `api`'s clients."""
    start = time.perf_counter()
    deadline = start + args.duration
    c = args.concurrency
    if api == "grpc":
        runs = [
            grpc_client(server.grpc_target, texts, k, c, args.new_tokens, deadline)
            for k in range(c)
        ]
        results = await asyncio.gather(*runs)
    else:
        runs = [
            http_client(server.http_url, model, prompts, k, c, args.new_tokens, deadline)
            for k in range(c)
        ]
        results = await asyncio.gather(*runs)
    tokens = sum(
        max((n for t, n in arrivals if t <= deadline), default=0)
        for client_runs in results
        for arrivals in client_runs
    )
    return tokens / args.duration


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = list(SERVING_PROMPTS)
    texts = [
        str(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            )
        )
        for p in prompts
    ]
    env = {"MAX_CONCURRENT_REQUESTS": str(max(512, 2 * args.concurrency))}
    rates: dict[str, list[float]] = {"grpc": [], "http": []}
    load_before = os.getloadavg()[0]
    with ServerProcess(args.model, env, Path("/tmp/specserve-bench-openai.log")) as server:
        asyncio.run(window("grpc", server, args.model, prompts, texts, _warmup(args)))
        order = ["grpc", "http", "http", "grpc"] * args.rounds
        for api in order[: 2 * args.rounds]:
            rate = asyncio.run(window(api, server, args.model, prompts, texts, args))
            rates[api].append(rate)
            print(f"{api:5s} {rate:8.1f} tokens/s", flush=True)
    load_after = os.getloadavg()[0]
    grpc_rate, http_rate = statistics.median(rates["grpc"]), statistics.median(rates["http"])
    result = {
        "model": args.model,
        "concurrency": args.concurrency,
        "new_tokens": args.new_tokens,
        "duration_s": args.duration,
        "grpc_tokens_per_s": rates["grpc"],
        "http_tokens_per_s": rates["http"],
        "ratio_http_over_grpc": http_rate / grpc_rate,
        "loadavg_1m_before": load_before,
        "loadavg_1m_after": load_after,
    }
    print(
        f"median: grpc {grpc_rate:.1f}, http {http_rate:.1f} tokens/s, "
        f"http/grpc {http_rate / grpc_rate:.2f} (load {load_before:.1f} -> {load_after:.1f})"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


def _warmup(args: Any) -> Any:
    return argparse.Namespace(**{**vars(args), "duration": min(5.0, args.duration)})


if __name__ == "__main__":
    main()
