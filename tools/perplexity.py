"""Perplexity of a model served float32, int8 and GPTQ, measured through the engine's own prompt
log-probabilities on held-out text.

The text is the training's held-out answers: the float32 model's greedy answers to the first
`--texts` evaluation prompts (training.prompts.eval_prompts, never used for training), each
after its chat-templated prompt. Perplexity counts the answer tokens only (each given
everything before it): exp(-mean log p). The answers are the float32 model's own, which
favours float32 a little; every format reads the same tokens.

GPTQ checkpoints are written by tools/gptq_writer.py (round to nearest, asymmetric, act-order)
under `--workdir`. `--llama-gguf` adds llama.cpp's perplexity of GGUF files of the same model on
the same tokens, through bench/llamacpp_child.py's `nll` mode in `--llama-python` (an
environment with llama-cpp-python, bench/bench_llamacpp.py).

    python -m tools.perplexity [--model PATH] [--formats float32,int8,gptq-4-128,gptq-4-32]
        [--llama-gguf FILE.gguf ... --llama-python PYTHON]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

import engine.quant.kernels
from engine.llm import LLM
from engine.paths import default_model_path
from engine.sampling.params import SamplingParams
from tools.gptq_writer import GptqOptions, write_gptq
from training.prompts import chat_prompt_ids, eval_prompts


def held_out_texts(model: Path, n: int, max_new_tokens: int) -> list[tuple[list[int], int]]:
    """(prompt + answer ids, where the answer starts) for the first `n` held-out prompts."""
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    prompts = chat_prompt_ids(tokenizer, eval_prompts()[:n])
    with LLM(model, dtype="float32", max_num_tokens=8192) as llm:
        outputs = llm.generate(prompts, max_new_tokens)
    return [(list(p) + o.token_ids, len(p)) for p, o in zip(prompts, outputs, strict=True)]


def perplexity(llm: LLM, texts: list[tuple[list[int], int]]) -> tuple[float, int]:
    """(exp of the mean negative log-probability of the answer tokens, tokens counted)."""
    params = SamplingParams(max_new_tokens=1, prompt_logprobs=True)
    engine = llm.engine
    for k, (ids, _) in enumerate(texts):
        engine.add_request(f"ppl-{k}", ids, params)
    details: dict[str, list[float]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            if out.prompt_logprobs is not None:
                details[out.request_id] = [t.logprob for t in out.prompt_logprobs]
    total, count = 0.0, 0
    for k, (_, start) in enumerate(texts):
        logprobs = details[f"ppl-{k}"]  # tokens 1 .. n-1
        answer = logprobs[start - 1 :]
        total -= sum(answer)
        count += len(answer)
    return math.exp(total / count), count


def llama_perplexity(
    python: str, gguf: Path, texts: list[tuple[list[int], int]], threads: int
) -> tuple[float, int]:
    """`perplexity` of llama.cpp running `gguf`: the child sums the log-probabilities of every
    token after the first, so the answers' share is the whole texts' minus their prompts'
    (causal: a prompt's tokens do not see the answer)."""
    from bench.bench_llamacpp import child

    with tempfile.TemporaryDirectory() as tmp:
        sums = []
        for name, seqs in (("full", [ids for ids, _ in texts]),
                           ("prompts", [ids[:start] for ids, start in texts])):  # fmt: skip
            path = Path(tmp) / f"{name}.json"
            path.write_text(json.dumps(seqs))
            out = child(python, "nll", str(gguf), str(path), str(threads))
            nll, tokens = out["nll"], out["tokens"]
            if not isinstance(nll, float | int) or not isinstance(tokens, int):
                raise SystemExit(f"llamacpp_child nll: unexpected result {out}")
            sums.append((float(nll), tokens))
    total, count = sums[0][0] - sums[1][0], sums[0][1] - sums[1][1]
    return math.exp(total / count), count


def checkpoint(model: Path, fmt: str, workdir: Path) -> tuple[Path, str | None]:
    """(folder, QUANTIZE) for `fmt`: float32, int8 or gptq-<bits>-<group size>."""
    if fmt in ("float32", "int8"):
        return model, None if fmt == "float32" else "int8"
    _, bits, group = fmt.split("-")
    folder = workdir / f"{model.name}-{fmt}"
    if not (folder / "quantize_config.json").is_file():
        options = GptqOptions(bits=int(bits), group_size=int(group), sym=False, act_order=True)
        write_gptq(model, folder, options)
    return folder, None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=default_model_path())
    p.add_argument("--formats", default="float32,int8,gptq-4-128,gptq-4-32")
    p.add_argument("--texts", type=int, default=8, help="held-out prompts answered")
    p.add_argument("--answer-tokens", type=int, default=64, help="greedy tokens per answer")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/specserve-perplexity"))
    p.add_argument(
        "--weight-only",
        action="store_true",
        help="float activations (CUDA's GPTQ product) instead of CPU's int8 ones, to separate "
        "the weights' share of the loss",
    )
    p.add_argument("--llama-gguf", type=Path, nargs="*", default=[], help="GGUF files to add")
    p.add_argument("--llama-python", default="python", help="a Python with llama-cpp-python")
    p.add_argument("--llama-threads", type=int, default=2)
    a = p.parse_args(argv)
    if a.weight_only:
        engine.quant.kernels.int8_activations = lambda device, method: False
    texts = held_out_texts(a.model, a.texts, a.answer_tokens)
    print("| format | perplexity | vs float32 | tokens | seconds |\n|---|---|---|---|---|")
    base = None
    for fmt in a.formats.split(","):
        folder, quantize = checkpoint(a.model, fmt, a.workdir)
        start = time.perf_counter()
        with LLM(folder, dtype="float32", max_num_tokens=8192, quantize=quantize) as llm:
            ppl, count = perplexity(llm, texts)
        base = ppl if base is None else base
        print(
            f"| {fmt} | {ppl:.3f} | {100 * (ppl / base - 1):+.2f}% | {count} | "
            f"{time.perf_counter() - start:.0f} |",
            flush=True,
        )
    for gguf in a.llama_gguf:
        start = time.perf_counter()
        ppl, count = llama_perplexity(a.llama_python, gguf, texts, a.llama_threads)
        vs = "" if base is None else f"{100 * (ppl / base - 1):+.2f}%"
        print(
            f"| llama.cpp {gguf.name} | {ppl:.3f} | {vs} | {count} | "
            f"{time.perf_counter() - start:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
