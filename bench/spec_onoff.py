"""Speculation on against off in one engine, in short alternating windows: the paired figure
that a shared host's drift cannot swamp.

Two servers taking turns (`bench_serving --speculator`) see the host change between their
windows by more than the few percent in question. Here one engine (SmolLM2 float32, the server's
adaptive policy) serves `concurrency` closed-loop clients (exactly `--new-tokens` tokens, the
first request of each client fewer so that the clients' requests end at different steps; on the
held-out serving prompts; greedy, or sampled at `--temperature` and `--top-p` with a random seed
per request) through `--rounds` pairs of `--window`-second windows, its speculator attached in
one window of each pair and detached in the other (the order alternating per pair). The clients
run on through the switches and the policy keeps what it learnt, as a server would; the first
pair of windows is uncounted. Per level: tokens/s on and off, their ratio, the quartiles of the
per-pair ratios, and the speculative steps taken. Writes bench/results/spec_onoff.json
(spec_onoff_sampled.json when sampled).

    python -m bench.spec_onoff --speculator PATH [--concurrency 1 4 16 32] [--rounds 16]
                               [--window 2.5] [--temperature 0.7 --top-p 0.9]
                               [--model PATH --quantize int8|gptq]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

from bench.chat_prompts import SERVING_PROMPTS
from engine import LLM
from engine.core import LLMEngine
from engine.paths import default_model_path
from engine.sampling.params import SamplingParams
from engine.spec_decode.drafter import Drafter
from training.prompts import chat_prompt_ids

RESULTS = Path(__file__).parent / "results"


def run_level(
    engine: LLMEngine,
    drafter: Drafter | None,
    prompts: list[list[int]],
    concurrency: int,
    params: SamplingParams,
    windows: list[str],
    seconds: float,
) -> list[tuple[int, int, float]]:
    """`concurrency` clients, each sending its next request when one finishes, through one
    `seconds` window per entry of `windows` ("on": the speculator attached, "off": detached):
    per window the tokens that arrived in it, the steps in it that verified draft trees and its
    length (its last step ends after the deadline). Client i's first request asks for
    (i + 1) / concurrency of `params`' tokens, so that the clients' requests end (and the next
    ones' prompts are computed) spread over the steps rather than all in one step, as with
    clients that did not arrive together."""
    ids = (f"c{concurrency}-{i}" for i in itertools.count())
    prompt_ids = itertools.cycle(prompts)
    live: set[str] = set()

    def send(request_params: SamplingParams = params) -> None:
        request_id = next(ids)
        engine.add_request(request_id, next(prompt_ids), request_params)
        live.add(request_id)

    for i in range(concurrency):
        num_tokens = max(1, params.max_new_tokens * (i + 1) // concurrency)
        send(replace(params, max_new_tokens=num_tokens, min_new_tokens=num_tokens))
    counts = []
    for name in windows:
        engine.set_drafter(drafter if name == "on" else None)
        start = time.perf_counter()
        num_tokens = num_spec_steps = 0
        while time.perf_counter() < start + seconds:
            outputs = engine.step().outputs
            num_spec_steps += any(o.draft_depth for o in outputs)
            for out in outputs:
                num_tokens += len(out.new_token_ids)
                if out.finished:
                    live.discard(out.request_id)
                    send()
        counts.append((num_tokens, num_spec_steps, time.perf_counter() - start))
    for request_id in live:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    engine.set_drafter(drafter)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=default_model_path())
    parser.add_argument("--speculator", type=Path, required=True)
    parser.add_argument("--quantize", choices=["int8", "gptq"], help="QUANTIZE (default: none)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--rounds", type=int, default=16, help="pairs of windows per level")
    parser.add_argument("--window", type=float, default=2.5, help="seconds per window")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    args = parser.parse_args()

    llm = LLM(args.model, dtype="float32", speculator=args.speculator, quantize=args.quantize)
    engine = llm.engine
    drafter = engine.drafter
    prompts = chat_prompt_ids(llm.tokenizer, SERVING_PROMPTS)
    params = SamplingParams(
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
    )
    rows = []
    header = f"{'clients':>7} {'off tok/s':>10} {'on tok/s':>9} {'on/off':>7} {'pair IQR':>13}"
    decoding = (
        f"temperature {args.temperature:g}, top-p {args.top_p:g}" if args.temperature else "greedy"
    )
    print(f"{decoding}\n{header} spec steps")
    for concurrency in args.concurrency:
        windows = ["off", "on"]  # uncounted: the clients' first requests, a first try of each
        for r in range(args.rounds):
            windows += ["on", "off"] if r % 2 else ["off", "on"]
        counts = run_level(engine, drafter, prompts, concurrency, params, windows, args.window)
        tokens = {"on": 0, "off": 0}
        seconds = {"on": 0.0, "off": 0.0}
        ratios, num_spec_steps = [], 0
        for r in range(1, args.rounds + 1):
            pair = dict(zip(windows[2 * r : 2 * r + 2], counts[2 * r : 2 * r + 2], strict=True))
            for name, (num_tokens, spec_steps, elapsed) in pair.items():
                tokens[name] += num_tokens
                seconds[name] += elapsed
                num_spec_steps += spec_steps
            ratios.append((pair["on"][0] / pair["on"][2]) / (pair["off"][0] / pair["off"][2]))
        rate = {name: tokens[name] / seconds[name] for name in tokens}
        row = {
            "concurrency": concurrency,
            "off_tokens_per_s": rate["off"],
            "on_tokens_per_s": rate["on"],
            "on_over_off": rate["on"] / rate["off"],
            "pair_ratio_median": statistics.median(ratios),
            "pair_ratio_quartiles": statistics.quantiles(ratios, n=4)[::2],
            "speculative_steps": num_spec_steps,
        }
        rows.append(row)
        q1, q3 = row["pair_ratio_quartiles"]
        print(
            f"{concurrency:>7} {row['off_tokens_per_s']:>10.1f} {row['on_tokens_per_s']:>9.1f} "
            f"{row['on_over_off']:>6.3f}x {q1:>6.3f}-{q3:<6.3f} {num_spec_steps}",
            flush=True,
        )
    path = RESULTS / ("spec_onoff_sampled.json" if args.temperature else "spec_onoff.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    result = {**vars(args), "model": args.model.name, "rows": rows}
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
