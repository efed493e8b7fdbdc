"""The engine thread: `EngineWorker` steps an `LLMEngine` on a daemon thread and delivers each
request's `EngineOutput`s (or the step's exception) to the request's sink.

The event loop hands it new and aborted requests through a thread-safe queue; for the gRPC
servicer a sink is `loop.call_soon_threadsafe(asyncio_queue.put_nowait, ...)`. Protobuf-free.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.core import EngineOutput, LLMEngine
from engine.device import use_device
from engine.request import PromptPrefix, RequestStatus
from engine.sampling.params import SamplingParams
from engine.spec_decode.policy import Method
from server.errors import GenerationError
from server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

GIL_SWITCH_INTERVAL_S = 0.0005
"""The process's GIL switch interval once a worker starts (Python's default: 5 ms). Every torch
op of an engine step releases the GIL and takes it back; when the event loop holds it meanwhile,
the engine thread waits up to one interval, hundreds of times per step."""


Sink = Callable[[EngineOutput | BaseException], None]


@dataclass
class RequestTiming:
    """`time.monotonic()` instants of one request: `arrival` at the server, `started` when the
    engine first scheduled it and `first_token` when a step first gave it tokens (None until
    then). The worker sets both before it delivers the outputs of that step, so a sink's
    consumer sees them with the first tokens."""

    arrival: float
    started: float | None = None
    first_token: float | None = None


@dataclass(frozen=True)
class Submission:
    """One request for the engine thread. `sink` receives, on the engine thread, every
    `EngineOutput` of the request (the last one finished) or one exception. `prompt_prefix`
    embeddings come before `prompt_token_ids` (see `LLMEngine.add_request`)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    time_limit_s: float | None
    sink: Sink
    timing: RequestTiming = field(default_factory=lambda: RequestTiming(time.monotonic()))
    prompt_prefix: PromptPrefix | None = None


class EngineWorker:
    """Runs `engine.step()` on a daemon thread while requests are unfinished, and blocks on its
    inbox otherwise. `submit`, `abort` and `stop` are thread-safe; the inputs of one `submit`
    are added before the same step. A failed step fails every live request (their sinks get a
    `GenerationError`) and marks the worker unhealthy until a step succeeds."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.healthy = False
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._live: dict[str, Submission] = {}  # added, not finished
        self._queued: dict[str, Submission] = {}  # added, never scheduled yet
        self._prefix_hit_tokens = 0  # the KV manager's count when last exported
        self._preemptions = 0  # the scheduler's count when last exported
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        """Start the engine thread; sets the process's GIL switch interval to
        GIL_SWITCH_INTERVAL_S."""
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self._thread.start()

    def submit(self, submissions: Sequence[Submission]) -> None:
        self._inbox.put(("add", list(submissions)))

    def abort(self, request_id: str) -> None:
        """Cancel a request; its sink gets no further output. Unknown ids are ignored."""
        self._inbox.put(("abort", request_id))

    def stop(self, timeout: float | None = None) -> None:
        """Stop after the current step; live requests are dropped without output."""
        self._inbox.put(("stop", None))
        self._thread.join(timeout)

    def probe(self, prompt_token_ids: list[int], timeout: float) -> bool:
        """Generate one token for a private request (TGIS's liveness prefill); True when the
        engine answered within `timeout` seconds."""
        done = threading.Event()
        result: list[EngineOutput | BaseException] = []

        def sink(item: EngineOutput | BaseException) -> None:
            if isinstance(item, BaseException) or item.finished:
                result.append(item)
                done.set()

        request_id = f"probe-{uuid.uuid4().hex}"
        params = SamplingParams(max_new_tokens=1)
        self.submit([Submission(request_id, prompt_token_ids, params, None, sink)])
        if not done.wait(timeout):
            self.abort(request_id)
            return False
        return isinstance(result[0], EngineOutput) and bool(result[0].new_token_ids)

    def _run(self) -> None:
        use_device(self.engine.runner.device)
        while not self._stopped:
            self._drain_inbox(block=not self.engine.has_unfinished_requests())
            if self._stopped or not self.engine.has_unfinished_requests():
                continue
            self._step()

    def _drain_inbox(self, block: bool) -> None:
        while not self._stopped:
            try:
                kind, arg = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if kind == "add":
                for s in arg:
                    try:
                        self.engine.add_request(
                            s.request_id,
                            s.prompt_token_ids,
                            s.params,
                            s.time_limit_s,
                            s.prompt_prefix,
                        )
                    except Exception as e:
                        s.sink(GenerationError(str(e)))
                    else:
                        self._live[s.request_id] = s
                        self._queued[s.request_id] = s
            elif kind == "abort":
                self._queued.pop(arg, None)
                if self._live.pop(arg, None) is not None:
                    self.engine.abort_request(arg)
            elif kind == "stop":
                self._stopped = True

    def _step(self) -> None:
        scheduler = self.engine.scheduler
        method = "prefill" if scheduler.num_waiting else "next_token"
        batch_size = min(
            scheduler.num_running + scheduler.num_waiting, scheduler.config.max_num_seqs
        )
        num_running_before = scheduler.num_running
        step_start = time.monotonic()
        start = time.perf_counter()
        m = self.metrics
        try:
            outputs = self.engine.step()
        except Exception as e:
            logger.exception("engine step failed")
            self.healthy = False
            if m is not None:
                m.batch_inference_failure.labels(method, "error").inc()
            for request_id, s in self._live.items():
                s.sink(GenerationError(str(e) or type(e).__name__))
                self.engine.abort_request(request_id)
            self._live.clear()
            self._queued.clear()
            return
        forward_end = time.perf_counter()
        step_end = time.monotonic()
        self.healthy = True
        joined = self._mark_started(step_start, outputs)
        methods: dict[str, Method] = {}
        for out in outputs:
            found = self._live.get(out.request_id)
            if found is None:
                continue
            if out.new_token_ids and found.timing.first_token is None:
                found.timing.first_token = step_end
            if out.finished:
                del self._live[out.request_id]
            methods[out.request_id] = Method.of(found.params)
            found.sink(out)
        if m is None:
            return
        end = time.perf_counter()
        m.batch_inference_count.labels(method).inc()
        m.batch_inference_success.labels(method).inc()
        m.batch_inference_duration.labels(method, "single_only").observe(end - start)
        m.batch_inference_forward_duration.labels(method, "single_only").observe(
            forward_end - start
        )
        m.batch_inference_tokproc_duration.labels(method, "single_only").observe(end - forward_end)
        m.batch_inference_batch_size.labels(method).observe(batch_size)
        for s in joined:
            m.request_queue_duration.observe(step_start - s.timing.arrival)
        if joined:
            m.batch_next_tokens.observe(sum(len(s.prompt_token_ids) for s in joined))
            if num_running_before:
                m.batch_concatenation_count.inc()
        running = scheduler.running
        m.batch_current_size.set(len(running))
        m.batch_input_tokens.set(sum(r.num_tokens for r in running))
        m.batch_max_remaining_tokens.set(
            sum(max(0, r.sampling_params.max_new_tokens - r.num_output_tokens) for r in running)
        )
        m.queue_size.set(scheduler.num_waiting)
        m.request_preemptions.inc(scheduler.num_preemptions - self._preemptions)
        self._preemptions = scheduler.num_preemptions
        m.kv_cache_blocks_used.set(self.engine.kv.num_used_blocks)
        hits = self.engine.kv.num_prefix_hit_tokens
        m.prefix_cache_hit_tokens.inc(hits - self._prefix_hit_tokens)
        self._prefix_hit_tokens = hits
        for out in outputs:
            if out.request_id in methods:
                m.observe_speculation(
                    out.draft_depth, out.num_accepted_tokens, methods[out.request_id]
                )
        if any(out.draft_depth for out in outputs):
            m.spec_step_duration.observe(forward_end - start)

    def _mark_started(self, step_start: float, outputs: Sequence[EngineOutput]) -> list[Submission]:
        """Set `timing.started` of the queued requests the last step scheduled (still live and
        no longer waiting, or gone with tokens); return them. Requests that left the queue
        without running (aborted, expired) are dropped from it."""
        if not self._queued:
            return []
        live = self.engine.scheduler.requests
        produced = {out.request_id for out in outputs if out.new_token_ids}
        joined = []
        for request_id, s in list(self._queued.items()):
            req = live.get(request_id)
            if req is not None and req.status == RequestStatus.WAITING:
                continue
            del self._queued[request_id]
            if req is not None or request_id in produced:
                s.timing.started = step_start
                joined.append(s)
        return joined
