"""Timing helpers shared by the benchmarks: the fastest of repeated runs, functions timed in
turn, one decode step's bare matrix products and one engine decode step."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine import LLM


def best_of(
    fn: Callable[[], object], repeats: int, *, seconds: float = 0.0, warmup: bool = False
) -> float:
    """Seconds of the fastest of `repeats` calls of `fn`, calling it on until `seconds` have
    passed too; after one untimed call first when `warmup`."""
    if warmup:
        fn()
    times = []
    end = time.perf_counter() + seconds
    while len(times) < repeats or time.perf_counter() < end:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def interleaved_min(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Seconds of each function's fastest run, the functions called in turn `repeats` times, so
    that a slow spell of a shared host hits all of them alike and ratios stay fair."""
    best = dict.fromkeys(fns, float("inf"))
    with torch.inference_mode():
        for fn in fns.values():
            fn()  # warm-up
        for _ in range(repeats):
            for name, fn in fns.items():
                start = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def matmul_floor(llm: LLM, batch: int) -> Callable[[], None]:
    """One decode step's linear layers alone, in model order, with the kernels the engine
    chose, on `batch` rows."""
    linears = llm.runner.model.linears()
    inputs = [torch.randn(batch, lin.in_features) for lin in linears]

    def step() -> None:
        for lin, x in zip(linears, inputs, strict=True):
            lin(x)

    return step


@contextmanager
def engine_step(llm: LLM, prompts: list[list[int]]) -> Iterator[Callable[[], object]]:
    """One decode forward pass (runner.execute) over len(prompts) sequences whose prompts are
    in the cache; the sequences are freed on exit."""
    from engine.model_runner import SequenceInput

    kv, runner = llm.kv, llm.runner
    for i, p in enumerate(prompts):
        kv.allocate_slots(("bench", i), len(p) + 1)
    try:
        prefill = [SequenceInput(p, 0, kv.block_table(("bench", i))) for i, p in enumerate(prompts)]
        runner.execute(prefill)
        decode = [
            SequenceInput([p[-1]], len(p), kv.block_table(("bench", i)))
            for i, p in enumerate(prompts)
        ]
        yield lambda: runner.execute(decode)
    finally:
        for i in range(len(prompts)):
            kv.free(("bench", i))
