"""Every thread that launches kernels makes the engine's CUDA device current (engine/device):
the thread that builds the engine and the server's engine thread. CUDA is not needed: the
calls reach a recording `torch.cuda.set_device`; the oracle is the configured device index."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.builder import build_engine
from engine.config import EngineConfig
from engine.device import use_device
from engine.llm import LLM
from engine.paths import model_path
from server.engine_worker import EngineWorker
from tests.reference import require_model


class _Stop(Exception):
    """Raised by the recording set_device when asked to end start-up there."""


class SetDevice:
    """Records (thread name, device index) of each torch.cuda.set_device call."""

    def __init__(self, stop: bool = False) -> None:
        self.calls: list[tuple[str, int]] = []
        self.stop = stop

    def __call__(self, device: int | str | torch.device) -> None:
        index = device if isinstance(device, int) else torch.device(device).index
        assert index is not None
        self.calls.append((threading.current_thread().name, index))
        if self.stop:
            raise _Stop


def test_use_device_sets_an_indexed_cuda_device_only(monkeypatch: pytest.MonkeyPatch) -> None:
    set_device = SetDevice()
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    use_device("cuda:1")
    use_device(torch.device("cuda", 3))
    use_device("cuda")
    use_device("cpu")
    main = threading.current_thread().name
    assert set_device.calls == [(main, 1), (main, 3)]


def test_build_engine_sets_the_device_before_anything_runs_on_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stopped at the call: nothing touched the (absent) CUDA device before it."""
    set_device = SetDevice(stop=True)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    path = require_model(model_path("tiny-llama-gqa-tied"))
    with pytest.raises(_Stop):
        build_engine(EngineConfig(path, device="cuda:2"))
    assert set_device.calls == [(threading.current_thread().name, 2)]


def test_the_engine_thread_sets_the_runner_device(monkeypatch: pytest.MonkeyPatch) -> None:
    path = require_model(model_path("tiny-llama-gqa-tied"))
    with LLM(path, max_num_tokens=256) as llm:
        set_device = SetDevice()
        monkeypatch.setattr(torch.cuda, "set_device", set_device)
        llm.runner.device = torch.device("cuda", 1)  # as a CUDA runner's; no step runs
        worker = EngineWorker(llm.engine)
        worker.start()
        worker.stop(timeout=10)
    assert set_device.calls == [("engine", 1)]
