"""The engine thread: `EngineWorker` steps an `LLMEngine` on a daemon thread and delivers each
request's `EngineOutput`s (or the step's exception) to the request's sink. It reads only what a
step returns (outputs, `StepStats`, `RequestEvent`s): the requests' timings and the metrics
come from those.

The event loop hands it new and aborted requests through a thread-safe queue; for the gRPC
servicer a sink is `loop.call_soon_threadsafe(asyncio_queue.put_nowait, ...)`. Protobuf-free.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.core import LLMEngine
from engine.outputs import EngineOutput, RequestEvent, RequestEventType, StepStats
from engine.request import PromptPrefix
from engine.sampling.params import SamplingParams
from engine.spec_decode.policy import Method
from server.errors import GenerationError
from server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

Sink = Callable[[EngineOutput | BaseException], None]


@dataclass
class RequestTiming:
    """`time.monotonic()` instants of one request: `arrival` at the server, `started` when the
    engine first scheduled it and `first_token` when a step first gave it tokens (None until
    then), as the step's events give them. The worker sets both before it delivers the outputs
    of that step, so a sink's consumer sees them with the first tokens."""

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
        self._stats = StepStats()  # of the last successful step: the queues the next one finds
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        """Start the engine thread."""
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
        self.engine.bind_thread()
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
        # The queues this step finds: the last step's, plus the requests added since (queued).
        before = self._stats
        method = "prefill" if self._queued or before.num_waiting_reqs else "next_token"
        start = time.perf_counter()
        try:
            step = self.engine.step()
        except Exception as e:
            self._fail(e, method)
            return
        forward_end = time.perf_counter()
        self.healthy = True
        self._stats = step.stats
        joined = self._apply_events(step.events)
        methods = self._deliver(step.outputs)
        m = self.metrics
        if m is None:
            return
        end = time.perf_counter()
        m.batch_inference_duration.labels(method, "single_only").observe(end - start)
        m.batch_inference_forward_duration.labels(method, "single_only").observe(
            forward_end - start
        )
        m.batch_inference_tokproc_duration.labels(method, "single_only").observe(end - forward_end)
        for s in joined:
            assert s.timing.started is not None
            m.request_queue_duration.observe(s.timing.started - s.timing.arrival)
        lengths = [len(s.prompt_token_ids) for s in joined]
        m.observe_step(method, step.stats, step.outputs, methods, lengths, before.num_running_reqs)
        if any(out.draft_depth for out in step.outputs):
            m.spec_step_duration.observe(forward_end - start)

    def _fail(self, error: Exception, method: str) -> None:
        """A failed step: every live request's sink gets a GenerationError and the engine
        aborts it; the worker is unhealthy until a step succeeds."""
        logger.exception("engine step failed")
        self.healthy = False
        if self.metrics is not None:
            self.metrics.batch_inference_failure.labels(method, "error").inc()
        for request_id, s in self._live.items():
            s.sink(GenerationError(str(error) or type(error).__name__))
            self.engine.abort_request(request_id)
        self._live.clear()
        self._queued.clear()

    def _apply_events(self, events: Sequence[RequestEvent]) -> list[Submission]:
        """Set the timings the events give (`started` at a queued request's first scheduling,
        `first_token`); return the queued submissions the step scheduled. Those that finished
        without running (aborted, expired, rejected) leave the queue."""
        joined = []
        for event in events:
            if event.type == RequestEventType.SCHEDULED:
                s = self._queued.pop(event.request_id, None)
                if s is not None:
                    s.timing.started = event.timestamp
                    joined.append(s)
            elif event.type == RequestEventType.FIRST_TOKEN:
                found = self._live.get(event.request_id)
                if found is not None and found.timing.first_token is None:
                    found.timing.first_token = event.timestamp
            elif event.type == RequestEventType.FINISHED:
                self._queued.pop(event.request_id, None)
        return joined

    def _deliver(self, outputs: Sequence[EngineOutput]) -> dict[str, str]:
        """Hand each live request its output; returns their decoding methods by request id."""
        methods: dict[str, str] = {}
        for out in outputs:
            found = self._live.get(out.request_id)
            if found is None:
                continue
            if out.finished:
                del self._live[out.request_id]
            methods[out.request_id] = Method.of(found.params)
            found.sink(out)
        return methods
