"""What a run reached: counters of the calls into the Triton attention backend and the CUDA-graph
step, so that a check that compares their outputs can also say that they ran (a comparison of
two runs that both skipped the graph step would pass without proving anything)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class Calls:
    """How often each wrapped method was called while `counting` was active."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def __getitem__(self, name: str) -> int:
        return self.counts.get(name, 0)


@contextmanager
def counting(targets: dict[str, tuple[type, str]]) -> Iterator[Calls]:
    """Count calls of `cls.method` for each `name: (cls, method)` (instances made before and
    during the block alike), restoring the methods afterwards."""
    calls = Calls()
    originals: list[tuple[type, str, Callable[..., Any]]] = []
    for name, (cls, method) in targets.items():
        original = getattr(cls, method)

        @functools.wraps(original)
        def wrapper(*args: Any, _name: str = name, _f: Any = original, **kwargs: Any) -> Any:
            calls.counts[_name] = calls.counts.get(_name, 0) + 1
            return _f(*args, **kwargs)

        originals.append((cls, method, original))
        setattr(cls, method, wrapper)
    try:
        yield calls
    finally:
        for cls, method, original in reversed(originals):
            setattr(cls, method, original)


@contextmanager
def triton_and_graphs() -> Iterator[Calls]:
    """Count `TritonBackend.forward` (each call launches the paged-attention kernel: compiled
    on CUDA, in Triton's interpreter on CPU) as "triton_launches" and `StepGraphs.run` (a step
    through the graphs' static buffers: replayed on CUDA, run eagerly on CPU) as
    "graph_steps"."""
    from engine.attention.triton_backend import TritonBackend
    from engine.cuda_graphs import StepGraphs

    targets = {"triton_launches": (TritonBackend, "forward"), "graph_steps": (StepGraphs, "run")}
    with counting(targets) as calls:
        yield calls


@contextmanager
def triton_on_cpu(device: str, block_size: int = 16) -> Iterator[None]:
    """On CPU, have every ModelRunner built in the block use the Triton backend (its kernel in
    the interpreter) and so its CUDA-graph step, as a CUDA runner does; nothing on CUDA."""
    if device.startswith("cuda"):
        yield
        return
    import engine.model_runner as model_runner
    from engine.attention.triton_backend import TritonBackend

    original = model_runner.select_backend
    model_runner.select_backend = lambda *args, **kwargs: TritonBackend(block_size)  # type: ignore[assignment]
    try:
        yield
    finally:
        model_runner.select_backend = original
