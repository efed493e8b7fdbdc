"""Greedy decode speed of this engine vs transformers' `generate`, and the matmul floor; then
the engine's quantized formats against its float32, at batch 1.

Same model, prompts and dtype for both, in one run. Decode tokens/s excludes the prefill:
`B * (N - 1) / (t(N new tokens) - t(1 new token))`. The floor is the time of every linear layer
of one decode step, run back to back with the same kernels the engine chose.

The quantized rows: the same model in float32, int8 (`QUANTIZE=int8`: quantized at load) and
GPTQ 4-bit with groups of 128 (a checkpoint `tools.gptq_writer` writes once, round to nearest,
into $SPECSERVE_HOME/models/<model>-gptq-4bit-g128, reused on later runs), each decoding
`--quant-new-tokens` greedy tokens at batch 1 for each of the first `--quant-prompts` chat
prompts, on torch's threads; rounds take every format in turn, so that a slow spell of a shared
host hits all of them, and each prompt's fastest round counts. Printed with each format's ratio
to float32; `--quant-prompts 0` skips them.

    python -m bench.bench_decode [--model PATH] [--new-tokens 64] [--batch-sizes 1 16]
        [--quant-prompts 8] [--quant-new-tokens 128] [--quant-rounds 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from bench.bench_llamacpp import gptq_folder
from bench.common import best_of, engine_step, interleaved_min, matmul_floor
from engine import LLM
from engine.paths import default_model_path
from training.prompts import CHAT_PROMPTS, chat_prompt_ids

RESULTS = Path(__file__).parent / "results" / "decode.json"


def decode_rate(generate: Callable[[int], object], batch: int, new_tokens: int) -> float:
    generate(2)  # warm-up
    t_full = best_of(lambda: generate(new_tokens), 2)
    t_prefill = best_of(lambda: generate(1), 3)
    return batch * (new_tokens - 1) / (t_full - t_prefill)


def quantized_rows(
    llm: LLM, model: Path, prompts: list[list[int]], new_tokens: int, rounds: int
) -> list[dict[str, object]]:
    """Batch-1 decode tokens/s of `llm` (float32) and of the same model in int8 and GPTQ 4-bit
    g128 over `prompts` (see the module docstring), with the ratio to float32."""
    kv_tokens = max(len(p) for p in prompts) + new_tokens + 16
    engines = {
        "float32": llm,
        "int8": LLM(model, dtype="float32", quantize="int8", max_num_tokens=kv_tokens),
        "gptq-4bit-g128": LLM(
            gptq_folder(model), dtype="float32", quantize="gptq", max_num_tokens=kv_tokens
        ),
    }

    def seconds(engine: LLM, prompt: list[int], n: int) -> float:
        start = time.perf_counter()
        engine.generate([prompt], n, ignore_eos=True)
        return time.perf_counter() - start

    best = {name: [float("inf")] * len(prompts) for name in engines}
    for engine in engines.values():
        engine.generate([prompts[0]], 2, ignore_eos=True)  # warm-up
    for _ in range(rounds):
        for name, engine in engines.items():
            for i, prompt in enumerate(prompts):
                decode = seconds(engine, prompt, new_tokens) - seconds(engine, prompt, 1)
                best[name][i] = min(best[name][i], decode)
    rows: list[dict[str, object]] = []
    for name in engines:
        rate = len(prompts) * (new_tokens - 1) / sum(best[name])
        rows.append({"format": name, "tok_s": rate})
    base = float(str(rows[0]["tok_s"]))
    for row in rows:
        row["vs_float32"] = float(str(row["tok_s"])) / base
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=default_model_path())
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--quant-prompts", type=int, default=8)
    parser.add_argument("--quant-new-tokens", type=int, default=128)
    parser.add_argument("--quant-rounds", type=int, default=2)
    args = parser.parse_args()

    llm = LLM(args.model, dtype="float32")
    tok = llm.tokenizer
    prompts = chat_prompt_ids(tok, CHAT_PROMPTS)

    # The engine is measured first: transformers' runs leave the process slower for it.
    rows = []
    for batch in args.batch_sizes:
        batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]

        def ours(n: int, bp: list[list[int]] = batch_prompts) -> object:
            return llm.generate(bp, n, ignore_eos=True)

        with engine_step(llm, batch_prompts) as decode:
            times = interleaved_min({"step": decode, "floor": matmul_floor(llm, batch)}, 20)
        step, floor = times["step"], times["floor"]
        rows.append(
            {
                "batch": batch,
                "engine_tok_s": decode_rate(ours, batch, args.new_tokens),
                "engine_step_ms": step * 1e3,
                "matmul_floor_ms": floor * 1e3,
                "step_over_floor": step / floor,
            }
        )

    quant_prompts = prompts[: args.quant_prompts]
    quantized: list[dict[str, object]] = []
    if quant_prompts:  # before transformers too
        quantized = quantized_rows(
            llm, args.model, quant_prompts, args.quant_new_tokens, args.quant_rounds
        )
    threads = torch.get_num_threads()

    hf = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32).eval()
    tok.padding_side = "left"
    for row in rows:
        batch = row["batch"]
        batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
        enc = tok.pad({"input_ids": batch_prompts}, return_tensors="pt")

        def theirs(n: int, enc: dict[str, torch.Tensor] = enc) -> object:
            with torch.no_grad():
                return hf.generate(
                    **enc, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                    pad_token_id=tok.pad_token_id or tok.eos_token_id,
                )  # fmt: skip

        row["transformers_tok_s"] = decode_rate(theirs, batch, args.new_tokens)
        row["speedup"] = row["engine_tok_s"] / row["transformers_tok_s"]

    base = next((r["engine_tok_s"] for r in rows if r["batch"] == 1), None)
    print(f"model {args.model.name}, float32, {torch.get_num_threads()} threads, "
          f"{args.new_tokens} new tokens")  # fmt: skip
    header = (
        f"{'batch':>5} {'engine tok/s':>13} {'HF tok/s':>9} {'speedup':>8} "
        f"{'vs own b1':>9} {'step ms':>8} {'matmul ms':>9} {'step/floor':>10}"
    )
    print(header)
    for r in rows:
        scale = r["engine_tok_s"] / base if base else float("nan")
        r["vs_engine_batch1"] = scale
        print(
            f"{r['batch']:>5} {r['engine_tok_s']:>13.1f} {r['transformers_tok_s']:>9.1f} "
            f"{r['speedup']:>7.2f}x {scale:>8.2f}x {r['engine_step_ms']:>8.2f} "
            f"{r['matmul_floor_ms']:>9.2f} {r['step_over_floor']:>10.3f}"
        )
    if quantized:
        print(f"\nbatch 1, {args.quant_new_tokens} new tokens, {len(quant_prompts)} prompts, "
              f"{threads} threads, fastest of {args.quant_rounds} rounds")  # fmt: skip
        print(f"{'format':>15} {'tok/s':>7} {'vs float32':>10}")
        for q in quantized:
            print(f"{q['format']:>15} {q['tok_s']:>7.1f} {q['vs_float32']:>9.2f}x")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "model": args.model.name,
                "machine": platform.processor(),
                "rows": rows,
                "quantized_batch1": quantized,
            },
            indent=2,
        )
    )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
