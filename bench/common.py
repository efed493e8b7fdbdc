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


def interleaved_rounds(
    fns: dict[str, Callable[[], object]], repeats: int
) -> dict[str, list[float]]:
    """Seconds of each function's run in each of `repeats` rounds, the functions called in turn
    within a round (after one warm-up call each), so that a slow spell of a shared host hits
    all of them alike: ratios of one round's times compare like with like."""
    rounds: dict[str, list[float]] = {name: [] for name in fns}
    with torch.inference_mode():
        for fn in fns.values():
            fn()  # warm-up
        for _ in range(repeats):
            for name, fn in fns.items():
                start = time.perf_counter()
                fn()
                rounds[name].append(time.perf_counter() - start)
    return rounds


def interleaved_min(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Seconds of each function's fastest run over `interleaved_rounds`."""
    return {name: min(times) for name, times in interleaved_rounds(fns, repeats).items()}


def matmul_floor(llm: LLM, batch: int) -> Callable[[], None]:
    """One greedy decode step's linear layers alone, in model order, with the kernels the
    engine chose, on `batch` rows, each called as the model calls it (`forward`, no module
    hooks; the LM head through `compute_logits` for argmax-only rows, so its screen where the
    engine has one)."""
    model = llm.runner.model
    linears = [lin for lin in model.linears() if lin is not model.lm_head]
    inputs = [torch.randn(batch, lin.in_features) for lin in linears]
    hidden = torch.randn(batch, model.config.hidden_size)

    def step() -> None:
        for lin, x in zip(linears, inputs, strict=True):
            lin.forward(x)
        model.compute_logits(hidden, argmax_only=True)

    return step


@contextmanager
def engine_step(llm: LLM, prompts: list[list[int]]) -> Iterator[Callable[[], object]]:
    """One greedy decode forward pass (runner.execute, rows read for their argmax only) over
    len(prompts) sequences whose prompts are in the cache; the sequences are freed on exit."""
    from engine.step_io import SequenceInput

    kv, runner = llm.kv, llm.runner
    for i, p in enumerate(prompts):
        kv.allocate_slots(("bench", i), len(p) + 1)
    try:
        prefill = [SequenceInput(p, 0, kv.block_table(("bench", i))) for i, p in enumerate(prompts)]
        runner.execute(prefill)
        decode = [
            SequenceInput([p[-1]], len(p), kv.block_table(("bench", i)), argmax_only=True)
            for i, p in enumerate(prompts)
        ]
        yield lambda: runner.execute(decode)
    finally:
        for i in range(len(prompts)):
            kv.free(("bench", i))
