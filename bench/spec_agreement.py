"""Greedy output through gRPC with and without a speculator, and its tokens per step against
the offline evaluation's.

Serves the model twice on the held-out evaluation prompts (`eval_prompts()`, in the chat
template, greedy, `--max-new-tokens` each, `--concurrency` at a time): once without a speculator
and once with SPECULATOR_PATH and SPECULATOR_ADAPTIVE=false (every step verifies the full tree,
as `specserve-train-speculator eval` does). Reports how many outputs differ, and the mean tokens
per speculative step from `tgi_spec_tokens_per_step` next to the offline evaluation's figure
(`training.json` in the speculator folder, or `--offline`).

    python -m bench.spec_agreement --speculator PATH [--max-new-tokens 128] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from transformers import AutoTokenizer

from engine.paths import default_model_path
from server.pb import generation_pb2 as pb
from server.pb import generation_pb2_grpc
from tools.server_process import ServerProcess
from training.prompts import chat_texts, eval_prompts


def serve_all(
    model: Path,
    env: dict[str, str],
    unset: tuple[str, ...],
    prompts: list[str],
    args: argparse.Namespace,
) -> tuple[list[str], dict[str, float]]:
    """Every prompt's greedy text, and the server's `tgi_spec_tokens_per_step` sum and count."""
    log = Path(f"/tmp/specserve-spec-agreement-{os.getpid()}.log")
    with ServerProcess(model, env, log, unset=unset) as server:
        with grpc.insecure_channel(server.grpc_target) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)

            def one(text: str) -> str:
                request = pb.BatchedGenerationRequest(
                    requests=[pb.GenerationRequest(text=text)],
                    params=pb.Parameters(
                        method=pb.GREEDY,
                        stopping=pb.StoppingCriteria(max_new_tokens=args.max_new_tokens),
                    ),
                )
                return str(stub.Generate(request, timeout=3600).responses[0].text)

            with ThreadPoolExecutor(args.concurrency) as pool:
                texts = list(pool.map(one, prompts))
        metrics = {
            name: server.metric(f'tgi_spec_tokens_per_step_{name}{{method="greedy"}}', 0.0)
            for name in ("sum", "count")
        }
    return texts, metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=default_model_path())
    parser.add_argument("--speculator", type=Path, required=True)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--offline", type=float, help="the offline tokens per step to compare")
    args = parser.parse_args()
    prompts = chat_texts(AutoTokenizer.from_pretrained(str(args.model)), eval_prompts())
    env = {"DTYPE_STR": "float32", "MAX_BATCH_SIZE": str(args.concurrency)}
    plain, _ = serve_all(args.model, env, ("SPECULATOR_PATH", "SPECULATOR_NAME"), prompts, args)
    spec_env = {
        **env,
        "SPECULATOR_PATH": str(args.speculator.resolve()),
        "SPECULATOR_ADAPTIVE": "false",
        "SPECULATOR_MAX_BATCH_SIZE": str(args.concurrency),
    }
    spec, metrics = serve_all(args.model, spec_env, (), prompts, args)
    differ = [i for i, (a, b) in enumerate(zip(plain, spec, strict=True)) if a != b]
    served = metrics["sum"] / metrics["count"] if metrics["count"] else float("nan")
    offline = args.offline
    report = args.speculator / "training.json"
    if offline is None and report.is_file():
        offline = json.loads(report.read_text()).get("eval", {}).get("tokens_per_step")
    print(f"{len(prompts)} held-out prompts, {args.max_new_tokens} greedy tokens each")
    print(f"outputs differing with the speculator: {len(differ)} {differ}")
    print(f"tokens per speculative step: server {served:.3f} over {metrics['count']:.0f} steps")
    if offline:
        print(f"offline evaluation {offline:.3f}: server / offline = {served / offline:.3f}")


if __name__ == "__main__":
    main()
