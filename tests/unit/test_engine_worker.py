"""The engine thread under failure: a request's own failure reaches its sink alone; a
failed forward pass fails the batch it ran, and the next requests are served as if nothing had
happened (transformers' greedy tokens, every KV block returned)."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.builder import build_engine
from engine.config import EngineConfig
from engine.core import LLMEngine
from engine.outputs import EngineOutput
from engine.paths import model_path
from engine.request import FinishReason
from engine.sampling.params import SamplingParams
from server.engine_worker import EngineWorker, RequestTiming, Submission
from server.errors import GenerationError
from server.metrics import ServerMetrics
from tests.reference import chat_prompt_ids, compare_greedy, hf_greedy, require_model

MODEL = "tiny-llama-gqa-tied"
MAX_NEW = 12
GREEDY = SamplingParams(max_new_tokens=MAX_NEW)


class FailingForward:
    """Wraps the real runner's `execute`: raises on the next `failures` calls, then runs it."""

    def __init__(self, engine: LLMEngine) -> None:
        self.execute = engine.runner.execute
        self.failures = 0
        engine.runner.execute = self  # type: ignore[method-assign,assignment]

    def __call__(self, *args: Any) -> Any:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("injected forward failure")
        return self.execute(*args)


@pytest.fixture(scope="module")
def path() -> Path:
    return require_model(model_path(MODEL))


@pytest.fixture
def worker(path: Path) -> Iterator[EngineWorker]:
    engine = build_engine(EngineConfig(path, dtype="float32", num_kv_blocks=128))
    worker = EngineWorker(engine)
    worker.start()
    yield worker
    worker.stop(timeout=10)


def generate(
    worker: EngineWorker, requests: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, list[int] | BaseException | EngineOutput]:
    """Submit together; per request its tokens, the exception its sink got, or its last output
    when that finished with an error."""
    inbox: queue.SimpleQueue[tuple[str, EngineOutput | BaseException]] = queue.SimpleQueue()

    def sink_of(request_id: str) -> Callable[[EngineOutput | BaseException], None]:
        return lambda item: inbox.put((request_id, item))

    worker.submit(
        [
            Submission(request_id, prompt, params, None, sink_of(request_id))
            for request_id, (prompt, params) in requests.items()
        ]
    )
    tokens: dict[str, list[int]] = {request_id: [] for request_id in requests}
    results: dict[str, list[int] | BaseException | EngineOutput] = {}
    while len(results) < len(requests):
        request_id, item = inbox.get(timeout=60)
        if isinstance(item, BaseException):
            results[request_id] = item
            continue
        tokens[request_id] += item.new_token_ids
        if item.finish_reason == FinishReason.ERROR:
            results[request_id] = item
        elif item.finished:
            results[request_id] = tokens[request_id]
    return results


def test_forward_failure_fails_its_batch_then_recovers(path: Path, worker: EngineWorker) -> None:
    prompts = [list(p) for p in chat_prompt_ids(path)[:3]]
    failing = FailingForward(worker.engine)
    failing.failures = 1
    failed = generate(worker, {f"a{i}": (p, GREEDY) for i, p in enumerate(prompts)})
    assert all(isinstance(r, GenerationError) for r in failed.values()), failed
    assert "injected forward failure" in str(failed["a0"])
    served = generate(worker, {f"b{i}": (p, GREEDY) for i, p in enumerate(prompts)})
    for i, prompt in enumerate(prompts):
        tokens = served[f"b{i}"]
        assert isinstance(tokens, list), tokens
        compare_greedy(tokens, hf_greedy(path, tuple(prompt), MAX_NEW))
    assert worker.healthy
    assert worker.engine.kv.num_used_blocks == 0


def test_request_failure_leaves_its_batch_alone(path: Path, worker: EngineWorker) -> None:
    prompts = [list(p) for p in chat_prompt_ids(path)[:3]]
    bad = SamplingParams(max_new_tokens=MAX_NEW, temperature=1e-40)
    results = generate(
        worker, {"bad": (prompts[0], bad), "g1": (prompts[1], GREEDY), "g2": (prompts[2], GREEDY)}
    )
    failed = results["bad"]
    assert isinstance(failed, EngineOutput) and failed.error is not None
    assert failed.error.startswith("token selection failed")
    for name, prompt in (("g1", prompts[1]), ("g2", prompts[2])):
        tokens = results[name]
        assert isinstance(tokens, list), tokens
        compare_greedy(tokens, hf_greedy(path, tuple(prompt), MAX_NEW))
    assert worker.healthy
    assert worker.engine.kv.num_used_blocks == 0


def test_metrics_and_timings_come_from_the_steps_reports(path: Path) -> None:
    """A pool too small for the batch: the worker's metrics and the requests' timings follow
    what the steps reported (preemptions, admissions, prompt tokens, the empty pool at the
    end), the timings in order, and the tokens are still transformers' greedy ones."""
    engine = build_engine(
        EngineConfig(path, dtype="float32", block_size=16, num_kv_blocks=14, max_num_seqs=8)
    )
    metrics = ServerMetrics(2048, MAX_NEW, 8)
    worker = EngineWorker(engine, metrics)
    worker.start()
    prompts = [list(p) for p in chat_prompt_ids(path)[:8]]
    params = SamplingParams(max_new_tokens=24)
    timings = {f"r{i}": RequestTiming(time.monotonic()) for i in range(len(prompts))}
    inbox: queue.SimpleQueue[tuple[str, EngineOutput | BaseException]] = queue.SimpleQueue()
    try:
        worker.submit(
            [
                Submission(rid, p, params, None, lambda o, r=rid: inbox.put((r, o)), timings[rid])
                for rid, p in zip(timings, prompts, strict=True)
            ]
        )
        tokens: dict[str, list[int]] = {rid: [] for rid in timings}
        done = 0
        while done < len(prompts):
            rid, item = inbox.get(timeout=120)
            assert isinstance(item, EngineOutput), item
            if item.new_token_ids:
                assert timings[rid].first_token is not None  # set before the tokens arrive
            tokens[rid] += item.new_token_ids
            done += item.finished
    finally:
        worker.stop(timeout=10)

    def value(name: str) -> float:
        found = metrics.registry.get_sample_value(name)
        assert found is not None, name
        return found

    num_preemptions = engine.scheduler.num_preemptions
    assert num_preemptions > 0
    assert value("tgi_request_preemptions_total") == num_preemptions
    assert value("tgi_request_queue_duration_count") == len(prompts)
    assert value("tgi_batch_next_tokens_sum") == sum(map(len, prompts))
    assert value("tgi_kv_cache_blocks_used") == value("tgi_batch_current_size") == 0
    assert value("tgi_queue_size") == value("tgi_batch_input_tokens") == 0
    for rid, timing in timings.items():
        assert timing.started is not None and timing.first_token is not None
        assert timing.arrival <= timing.started < timing.first_token
        prompt = prompts[int(rid[1:])]
        compare_greedy(tokens[rid], hf_greedy(path, tuple(prompt), 24))
