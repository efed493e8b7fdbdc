"""llama.cpp's side of `bench.bench_llamacpp`, run by the interpreter that has llama-cpp-python.

It imports nothing of specserve, so it runs in a separate venv. Token ids in, JSON out:

    python bench/llamacpp_child.py quantize SRC.gguf DST.gguf FTYPE
    python bench/llamacpp_child.py decode MODEL.gguf IDS.json NEW_TOKENS THREADS
    python bench/llamacpp_child.py nll MODEL.gguf IDS.json THREADS

`decode` prints, per prompt, the greedy tokens and the decode tokens/s (from the first new token
to the last); `nll` prints the summed negative log-likelihood of each sequence's tokens after
the first and how many tokens it covers. `FTYPE` is llama.cpp's file type number (0: all F32,
7: Q8_0, 2: Q4_0); a quantized source is dequantized first (`allow_requantize`).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np


def quantize(src: str, dst: str, ftype: int) -> dict[str, Any]:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize({src} -> {dst}, ftype {ftype}) returned {rc}")
    return {"path": dst}


def load(path: str, threads: int, logits_all: bool = False) -> llama_cpp.Llama:
    return llama_cpp.Llama(
        model_path=path,
        n_ctx=2048,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=logits_all,
        verbose=False,
    )


def decode(path: str, prompts: list[list[int]], new_tokens: int, threads: int) -> dict[str, Any]:
    llm = load(path, threads)
    results = []
    for ids in prompts:
        llm.reset()
        out: list[int] = []
        first = last = 0.0
        for tok in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            last = time.perf_counter()
            if not out:
                first = last
            out.append(int(tok))
            if len(out) == new_tokens:
                break
        results.append({"token_ids": out, "tok_s": (len(out) - 1) / (last - first)})
    return {"prompts": results}


def nll(path: str, sequences: list[list[int]], threads: int) -> dict[str, Any]:
    llm = load(path, threads, logits_all=True)
    total, count = 0.0, 0
    for ids in sequences:
        llm.reset()
        llm.eval(ids)
        logits = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        total -= float(logp[np.arange(len(ids) - 1), ids[1:]].sum())
        count += len(ids) - 1
    return {"nll": total, "tokens": count}


def main(argv: list[str]) -> None:
    mode, *args = argv
    if mode == "quantize":
        out = quantize(args[0], args[1], int(args[2]))
    elif mode == "decode":
        prompts = json.loads(Path(args[1]).read_text())
        out = decode(args[0], prompts, int(args[2]), int(args[3]))
    elif mode == "nll":
        out = nll(args[0], json.loads(Path(args[1]).read_text()), int(args[2]))
    else:
        raise SystemExit(f"unknown mode {mode!r}: quantize, decode or nll")
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
