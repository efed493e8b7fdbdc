"""Sampled against greedy decode: the same 32 requests, once with mixed sampled parameters and
once greedy, batch decode through the engine on the CPU, speculation off and on.

Each of the 32 requests (held-out chat prompts, `ignore_eos`, 64 new tokens) samples with one of
six parameter sets: temperature with top-k, top-p, typical-p and a repetition penalty, alone and
combined (`SAMPLED`; `--mix top-k` gives every set a top-k). Rounds alternate greedy and sampled
batches (the order flips each round), so a slow spell of a shared host hits both; the table
gives the median decode tokens/s of each and the median of the rounds' sampled/greedy ratios.
Decode time runs from the step after every request has its first token to the last step.

Speculation on uses the default model's trained speculator when `make speculator` made it, else
a random-weight one (`tools.tiny_speculator`: drafts are rarely accepted, so it measures the cost
of sampling every tree node), every step drafting for all 32 requests (no adaptive policy).

    python -m bench.bench_sampling [--rounds 3] [--requests 32] [--max-new-tokens 64]
        [--mix mixed|top-k] [--speculation off|on|both]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from bench.chat_prompts import SERVING_PROMPTS
from engine import LLM
from engine.paths import default_model_path, speculators_dir
from engine.sampling.params import SamplingParams
from tools.tiny_speculator import write_tiny_speculator
from training.prompts import chat_prompt_ids

SAMPLED = [
    SamplingParams(temperature=0.7, top_k=50),
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=1.0, typical_p=0.9),
    SamplingParams(temperature=0.9, repetition_penalty=1.2),
    SamplingParams(temperature=0.7, top_k=40, top_p=0.95, repetition_penalty=1.1),
    SamplingParams(temperature=0.8, top_p=0.9, typical_p=0.95, repetition_penalty=1.1),
]
TOP_K_FOR_ALL = 50  # --mix top-k: the top-k of the sets without one


def request_params(mix: str, num_requests: int, max_new_tokens: int) -> list[SamplingParams]:
    """Request i's sampled parameters: set i mod 6, seed i."""
    out = []
    for i in range(num_requests):
        p = SAMPLED[i % len(SAMPLED)]
        if mix == "top-k" and p.top_k == 0:
            p = replace(p, top_k=TOP_K_FOR_ALL)
        out.append(replace(p, max_new_tokens=max_new_tokens, ignore_eos=True, seed=i))
    return out


def decode(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, int]:
    """(seconds, tokens) of the batch's decode: the steps after every request's first token."""
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"bench-{i}", prompt, p)
    first: set[str] = set()
    while len(first) < len(prompts):
        first |= {o.request_id for o in engine.step().outputs if o.new_token_ids}
    tokens, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        tokens += sum(len(o.new_token_ids) for o in engine.step().outputs)
    return time.perf_counter() - start, tokens


def measure(
    llm: LLM, prompts: list[list[int]], sampled: list[SamplingParams], rounds: int
) -> dict[str, list[float]]:
    """Tokens/s per round of the greedy and the sampled batch, and their ratio."""
    greedy = [SamplingParams(max_new_tokens=p.max_new_tokens, ignore_eos=True) for p in sampled]
    batches = {"greedy": greedy, "sampled": sampled}
    for params in batches.values():  # warm-up
        decode(llm, prompts, [replace(p, max_new_tokens=4) for p in params])
    rates: dict[str, list[float]] = {"greedy": [], "sampled": [], "ratio": []}
    for r in range(rounds):
        order = ["greedy", "sampled"] if r % 2 == 0 else ["sampled", "greedy"]
        for name in order:
            seconds, tokens = decode(llm, prompts, batches[name])
            rates[name].append(tokens / seconds)
        rates["ratio"].append(rates["sampled"][-1] / rates["greedy"][-1])
    return rates


def speculator(tmp: Path, model: Path) -> tuple[Path, str]:
    trained = speculators_dir() / f"{model.name}-accelerator"
    if (trained / "config.json").is_file():
        return trained, "trained"
    return write_tiny_speculator(tmp / "speculator", model, n_predict=3), "random"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--mix", choices=("mixed", "top-k"), default="mixed")
    parser.add_argument("--speculation", choices=("off", "on", "both"), default="both")
    args = parser.parse_args()
    model = default_model_path()
    sampled = request_params(args.mix, args.requests, args.max_new_tokens)
    print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")  # fmt: skip
    print(f"{args.requests} requests x {args.max_new_tokens} tokens, {model.name} float32, "
          f"mix {args.mix}, {args.rounds} interleaved rounds (medians)")  # fmt: skip
    print("| speculation | greedy tok/s | sampled tok/s | sampled/greedy |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        modes: list[tuple[str, Path | None]] = []
        if args.speculation != "on":
            modes.append(("off", None))
        if args.speculation != "off":
            path, kind = speculator(Path(tmp), model)
            modes.append((f"on ({kind} speculator)", path))
        for name, spec in modes:
            llm = LLM(model, dtype="float32", speculator=spec,
                      spec_max_batch_size=args.requests, adaptive_speculation=False)  # fmt: skip
            prompts = chat_prompt_ids(llm.tokenizer, [
                SERVING_PROMPTS[i % len(SERVING_PROMPTS)] for i in range(args.requests)
            ])  # fmt: skip
            rates = measure(llm, prompts, sampled, args.rounds)
            llm.close()
            med = {k: statistics.median(v) for k, v in rates.items()}
            print(f"| {name} | {med['greedy']:.1f} | {med['sampled']:.1f} | "
                  f"{med['ratio']:.2f}x |", flush=True)  # fmt: skip
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
