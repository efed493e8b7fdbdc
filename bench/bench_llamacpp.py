"""Batch-1 greedy decode of the default model, specserve against llama.cpp, side by side in one
run: specserve in float32, int8 (quantized at load) and GPTQ 4-bit (group 128, written by
`tools.gptq_writer`; with the LM head in float32, and quantized too), llama.cpp (llama-cpp-
python) in F32, Q8_0 and Q4_0, all on the same threads, the same chat prompts (token ids) and
the same number of new tokens.

llama.cpp runs in its own interpreter (`--llama-python`: a venv with llama-cpp-python, kept out
of this project's dependencies) through `bench/llamacpp_child.py`. Its files are made from the
Q4_1 GGUF the default model is converted from (`tools.prepare_models`): dequantized to F32,
which holds the same weights as specserve's float32 folder, then quantized to Q8_0 and Q4_0.
They and the GPTQ folder are cached under $SPECSERVE_HOME.

Rounds run every backend in turn, so a slow spell of a shared host hits all of them; the table
gives each backend's median decode tokens/s (first new token to last, per prompt) and ratios of
medians. The greedy tokens of specserve float32 and llama.cpp F32 are compared as a sanity
check of the files (a near-tie may still split them).

    python -m bench.bench_llamacpp --llama-python /path/to/venv/bin/python
        [--rounds 2] [--prompts 8] [--new-tokens 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch

from engine import LLM
from engine.paths import default_model_path, specserve_home
from engine.sampling.params import SamplingParams
from tools.gptq_writer import GptqOptions, write_gptq
from tools.prepare_models import download_smollm2_gguf
from training.prompts import CHAT_PROMPTS, chat_prompt_ids

CHILD = Path(__file__).with_name("llamacpp_child.py")
GGUF_TYPES = {"F32": 0, "Q8_0": 7, "Q4_0": 2}  # llama.cpp's file type numbers
SPECSERVE = {"float32": None, "int8": "int8", "gptq-4bit": "gptq", "gptq-4bit-head": "gptq"}
PAIRS = [("float32", "F32"), ("int8", "Q8_0"), ("gptq-4bit", "Q4_0"), ("gptq-4bit-head", "Q4_0")]


def llama_decode(python: str, argv: list[str]) -> list[dict[str, object]]:
    """llama.cpp's per-prompt decode results (`child`'s "decode" mode)."""
    return cast(list[dict[str, object]], child(python, *argv)["prompts"])


def child(python: str, *args: str) -> dict[str, object]:
    """Run llamacpp_child.py in `python`; its JSON result."""
    proc = subprocess.run([python, str(CHILD), *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(
            f"llamacpp_child {args[0]} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}"
        )
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def gguf_files(python: str) -> dict[str, Path]:
    """F32, Q8_0 and Q4_0 GGUFs of the default model, made once into $SPECSERVE_HOME/gguf."""
    folder = specserve_home() / "gguf"
    folder.mkdir(parents=True, exist_ok=True)
    files = {name: folder / f"SmolLM2-135M-Instruct.{name}.gguf" for name in GGUF_TYPES}
    if not all(f.is_file() for f in files.values()):
        with tempfile.TemporaryDirectory() as work:
            source = download_smollm2_gguf(Path(work))
            child(python, "quantize", str(source), str(files["F32"]), "0")
        for name in ("Q8_0", "Q4_0"):
            child(python, "quantize", str(files["F32"]), str(files[name]), str(GGUF_TYPES[name]))
    return files


def gptq_folder(model: Path, lm_head: bool = False) -> Path:
    """The default model as a GPTQ 4-bit, group-128 symmetric checkpoint (with `lm_head`, its LM
    head quantized too), written once."""
    dst = specserve_home() / "models" / f"{model.name}-gptq-4bit-g128{'-head' if lm_head else ''}"
    if not (dst / "quantize_config.json").is_file():
        write_gptq(model, dst, GptqOptions(bits=4, group_size=128, lm_head=lm_head))
    return dst


def specserve_decode(
    llm: LLM, prompts: list[list[int]], new_tokens: int
) -> list[dict[str, object]]:
    """Per prompt, alone in the engine: greedy tokens and decode tokens/s."""
    engine, results = llm.engine, []
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"p{i}-{time.monotonic_ns()}", ids, params)
        tokens: list[int] = []
        first = last = 0.0
        while engine.has_unfinished_requests():
            for out in engine.step().outputs:
                if out.new_token_ids:
                    last = time.perf_counter()
                    first = first or last
                    tokens += out.new_token_ids
        results.append({"token_ids": tokens, "tok_s": (len(tokens) - 1) / (last - first)})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-python", required=True, help="python with llama-cpp-python")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model = default_model_path()
    ggufs = gguf_files(args.llama_python)
    folders = {
        "float32": model,
        "int8": model,
        "gptq-4bit": gptq_folder(model),
        "gptq-4bit-head": gptq_folder(model, lm_head=True),
    }
    engines = {
        name: LLM(folders[name], dtype="float32", quantize=quantize)
        for name, quantize in SPECSERVE.items()
    }
    prompts = chat_prompt_ids(engines["float32"].tokenizer, CHAT_PROMPTS)[: args.prompts]

    with tempfile.NamedTemporaryFile("w", suffix=".json") as ids_file:
        json.dump(prompts, ids_file)
        ids_file.flush()
        runs: dict[str, Callable[[], list[dict[str, object]]]] = {
            name: functools.partial(specserve_decode, llm, prompts, args.new_tokens)
            for name, llm in engines.items()
        }
        for name, path in ggufs.items():
            argv = ["decode", str(path), ids_file.name, str(args.new_tokens), str(args.threads)]
            runs[f"llama.cpp {name}"] = functools.partial(llama_decode, args.llama_python, argv)
        for run in runs.values():  # warm-up: kernels chosen, files in the page cache
            run()
        rates: dict[str, list[float]] = {name: [] for name in runs}
        tokens: dict[str, list[list[int]]] = {}
        for _ in range(args.rounds):
            for name, run in runs.items():
                results = run()
                rates[name] += [float(r["tok_s"]) for r in results]  # type: ignore[arg-type]
                tokens[name] = [list(r["token_ids"]) for r in results]  # type: ignore[call-overload]

    median = {name: statistics.median(r) for name, r in rates.items()}
    print(
        f"host: {platform.processor() or platform.machine()}, {args.threads} threads, "
        f"load {os.getloadavg()[0]:.1f}; {args.prompts} prompts x {args.new_tokens} tokens, "
        f"{args.rounds} rounds, median decode tok/s"
    )
    for name, rate in median.items():
        print(f"  {name:22s} {rate:7.1f}")
    for ours, theirs in PAIRS:
        print(f"  {ours} / llama.cpp {theirs}: {median[ours] / median['llama.cpp ' + theirs]:.2f}x")
    for name in ("int8", "gptq-4bit"):
        print(f"  {name} / float32: {median[name] / median['float32']:.2f}x")
    same = sum(a == b for a, b in zip(tokens["float32"], tokens["llama.cpp F32"], strict=True))
    print(f"  float32 and llama.cpp F32 greedy tokens equal on {same} of {len(prompts)} prompts")


if __name__ == "__main__":
    main()
