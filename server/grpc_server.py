"""`fmaas.GenerationService` on grpc.aio, over an `LLMEngine` running on its own thread.

Three layers, each protobuf-free except the servicer:

- `EngineWorker` owns the engine thread. The event loop hands it new and aborted requests
  through a thread-safe queue; it steps the engine and delivers each `EngineOutput` (or the
  step's exception) to the request's sink, which for the servicer is
  `loop.call_soon_threadsafe(asyncio_queue.put_nowait, ...)`.
- `OutputTracker` is TGIS's router logic for one input: UTF-8-safe incremental detokenization,
  stop sequences on the decoded text (§4.5), the TGIS stop reason, split into `OutputChunk`s.
- `GenerationServicer` is the thin RPC layer: admission (MAX_CONCURRENT_REQUESTS), validation,
  tokenization, and `server.convert` for every message; `handle_errors` maps exceptions to
  status codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from transformers import PreTrainedTokenizerBase

from engine.engine import EngineOutput, LLMEngine
from engine.request import FinishReason
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams
from server import convert
from server.convert import OutputChunk, TokenDetail
from server.metrics import ServerMetrics
from server.pb import generation_pb2 as pb
from server.pb import generation_pb2_grpc
from server.validation import (
    DecodingParams,
    Limits,
    ValidationError,
    prefix_lookup_error,
    prefix_not_found_reason,
    request_parameters,
    tokenizer_error,
    validate_input,
)

logger = logging.getLogger(__name__)

OVERLOADED_MSG = "Model is overloaded"


class Overloaded(Exception):
    """More inputs in flight than MAX_CONCURRENT_REQUESTS allows (RESOURCE_EXHAUSTED)."""


class GenerationError(Exception):
    """The engine failed a request (UNKNOWN, ``Request failed during generation: ...``)."""


Sink = Callable[[EngineOutput | BaseException], None]


@dataclass(frozen=True)
class Submission:
    """One request for the engine thread. `sink` receives, on the engine thread, every
    `EngineOutput` of the request (the last one finished) or one exception."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    time_limit_s: float | None
    sink: Sink


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
        self._sinks: dict[str, Sink] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
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
                            s.request_id, s.prompt_token_ids, s.params, s.time_limit_s
                        )
                    except Exception as e:
                        s.sink(GenerationError(str(e)))
                    else:
                        self._sinks[s.request_id] = s.sink
            elif kind == "abort":
                if self._sinks.pop(arg, None) is not None:
                    self.engine.abort_request(arg)
            elif kind == "stop":
                self._stopped = True

    def _step(self) -> None:
        scheduler = self.engine.scheduler
        method = "prefill" if scheduler.num_waiting else "next_token"
        batch_size = min(
            scheduler.num_running + scheduler.num_waiting, scheduler.config.max_num_seqs
        )
        start = time.perf_counter()
        m = self.metrics
        try:
            outputs = self.engine.step()
        except Exception as e:
            logger.exception("engine step failed")
            self.healthy = False
            if m is not None:
                m.batch_inference_failure.labels(method, "error").inc()
            for request_id, sink in self._sinks.items():
                sink(GenerationError(str(e) or type(e).__name__))
                self.engine.abort_request(request_id)
            self._sinks.clear()
            return
        self.healthy = True
        for out in outputs:
            found = self._sinks.get(out.request_id)
            if found is None:
                continue
            sink = found
            if out.finished:
                del self._sinks[out.request_id]
            sink(out)
        if m is not None:
            m.batch_inference_count.labels(method).inc()
            m.batch_inference_success.labels(method).inc()
            m.batch_inference_duration.labels(method, "single_only").observe(
                time.perf_counter() - start
            )
            m.batch_inference_batch_size.labels(method).observe(batch_size)
            m.batch_current_size.set(scheduler.num_running)
            m.queue_size.set(scheduler.num_waiting)
            m.kv_cache_blocks_used.set(self.engine.kv.num_used_blocks)


class IncrementalDetokenizer:
    """Decodes a token stream as a continuation of `context_ids` (so a leading space survives)
    and returns only complete text: a delta ending in U+FFFD (incomplete UTF-8) is held back
    until later tokens complete it, or until `flush()`."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        context_ids: Sequence[int],
        skip_special_tokens: bool,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(context_ids)
        self._prefix = 0
        self._read = len(self._ids)

    def _delta(self, final: bool) -> str:
        decode = self._tokenizer.decode
        prefix_text = str(
            decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        )
        new_text = str(decode(self._ids[self._prefix :], skip_special_tokens=self._skip))
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            self._prefix, self._read = self._read, len(self._ids)
            return str(new_text[len(prefix_text) :])
        return ""

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._delta(final=False)

    def flush(self) -> str:
        """Whatever is still held back, incomplete characters included."""
        return self._delta(final=True)


class OutputTracker:
    """TGIS's per-input output rules (§4.5, §6.4) over the engine's tokens.

    `add` turns a `EngineOutput` into one `OutputChunk` per token; the last chunk is finished.
    A final EOS token is counted but not decoded. From `min_new_tokens` on, a stop sequence
    found in the text the token added finishes the request (STOP_SEQUENCE) and cuts the text
    after (or, when not included, before) the match; the caller must then abort the engine
    request. When stop sequences are excluded, the last `len(longest) - 1` characters are held
    back, so that text already handed out never needs retracting.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        params: DecodingParams,
        include_stop_sequence: bool,
        skip_special_tokens: bool,
    ) -> None:
        self._tokenizer = tokenizer
        self._params = params
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids[-5:], skip_special_tokens)
        self._include = include_stop_sequence
        longest = max((len(s) for s in params.stop_sequences), default=0)
        self._holdback = 0 if include_stop_sequence else max(longest - 1, 0)
        self._text = ""
        self._sent = 0
        self.count = 0
        self.finished = False
        self.prompt_logprobs: list[TokenLogprobs] | None = None

    def add(self, out: EngineOutput) -> list[OutputChunk]:
        if out.finish_reason == FinishReason.ERROR:
            raise GenerationError("request could not be scheduled")
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        chunks = []
        for i, token in enumerate(out.new_token_ids):
            last = out.finished and i == len(out.new_token_ids) - 1
            lp = out.logprobs[i] if out.logprobs is not None else None
            chunks.append(self._add_token(token, lp, out.finish_reason if last else None))
            if self.finished:
                return chunks
        if out.finished and not self.finished:  # finished without a token (time limit)
            chunks.append(self._finish(out.finish_reason or FinishReason.CANCELLED, None))
        return chunks

    def _add_token(
        self, token: int, lp: TokenLogprobs | None, reason: FinishReason | None
    ) -> OutputChunk:
        self.count += 1
        old_len = len(self._text)
        if reason != FinishReason.EOS_TOKEN:
            self._text += self._detok.add(token)
        detail = self._token_detail(token, lp)
        if reason is None and self.count >= self._params.min_new_tokens:
            match = self._find_stop_sequence(old_len)
            if match is not None:
                start, stop = match
                self._text = self._text[: start + len(stop) if self._include else start]
                return self._finish(FinishReason.STOP_SEQUENCE, detail, stop)
        if reason is not None:
            return self._finish(reason, detail)
        end = max(self._sent, len(self._text) - self._holdback)
        chunk = OutputChunk(self._text[self._sent : end], self.count, detail)
        self._sent = end
        return chunk

    def _finish(
        self, reason: FinishReason, detail: list[TokenDetail] | None, stop: str = ""
    ) -> OutputChunk:
        self.finished = True
        if reason != FinishReason.STOP_SEQUENCE:
            self._text += self._detok.flush()
        stop_reason = convert.stop_reason(reason, self._params.max_is_token_limit)
        return OutputChunk(self._text[self._sent :], self.count, detail or [], stop_reason, stop)

    def _find_stop_sequence(self, old_len: int) -> tuple[int, str] | None:
        """The first stop sequence (in request order) ending in the newly added text, and its
        last start position there."""
        for stop in self._params.stop_sequences:
            start = self._text.rfind(stop, max(0, old_len - len(stop) + 1))
            if start >= 0:
                return start, stop
        return None

    def _token_detail(self, token: int, lp: TokenLogprobs | None) -> list[TokenDetail]:
        if not self._params.generated_tokens:
            return []
        if lp is None:
            return [TokenDetail(self._pieces([token])[0])]
        return [convert.token_detail(lp, self._params, self._pieces)]

    def input_tokens(self, token_ids: Sequence[int]) -> list[TokenDetail]:
        """The `input_tokens` details of the input `token_ids` (see convert)."""
        return convert.input_token_details(
            token_ids, self.prompt_logprobs, self._params, self._pieces
        )

    def _pieces(self, token_ids: Sequence[int]) -> list[str]:
        return [str(t) for t in self._tokenizer.convert_ids_to_tokens(list(token_ids))]


@dataclass(frozen=True)
class PreparedInput:
    """A validated, tokenized input: `input_token_ids` after truncation (their count is the
    reported input_token_count); `prompt_token_ids` go to the model: the same, or a single
    BOS/EOS for an empty input."""

    text: str
    input_token_ids: list[int]
    prompt_token_ids: list[int]
    input_token_count: int
    params: DecodingParams


T = TypeVar("T")


def handle_errors(kind: str) -> Callable[[T], T]:
    """Map exceptions of an RPC handler (coroutine or async generator) to gRPC statuses:
    ValidationError -> INVALID_ARGUMENT with its exact message, Overloaded ->
    RESOURCE_EXHAUSTED "Model is overloaded", GenerationError and anything else -> UNKNOWN.
    Counts each failure in `tgi_request_failure` and cancellations as err="cancelled"."""

    def decorate(fn: Any) -> Any:
        async def fail(
            self: GenerationServicer, context: grpc.aio.ServicerContext, e: Exception
        ) -> None:
            code, err, message = grpc.StatusCode.UNKNOWN, "unknown", str(e)
            if isinstance(e, ValidationError):
                code, err, message = grpc.StatusCode.INVALID_ARGUMENT, "validation", e.message
            elif isinstance(e, Overloaded):
                code, err, message = grpc.StatusCode.RESOURCE_EXHAUSTED, "conc_limit", str(e)
            elif isinstance(e, GenerationError):
                err, message = "generate", f"Request failed during generation: {e}"
            else:
                logger.exception("%s failed", fn.__name__)
            self.metrics.request_failure.labels(err).inc()
            await context.abort(code, message)

        if inspect.isasyncgenfunction(fn):

            @functools.wraps(fn)
            async def stream_wrapper(
                self: GenerationServicer, request: Any, context: grpc.aio.ServicerContext
            ) -> AsyncIterator[Any]:
                try:
                    async for item in fn(self, request, context):
                        yield item
                except grpc.aio.AbortError:
                    raise
                except asyncio.CancelledError:
                    self.metrics.request_failure.labels("cancelled").inc()
                    raise
                except Exception as e:
                    await fail(self, context, e)

            return stream_wrapper

        @functools.wraps(fn)
        async def wrapper(
            self: GenerationServicer, request: Any, context: grpc.aio.ServicerContext
        ) -> Any:
            try:
                return await fn(self, request, context)
            except grpc.aio.AbortError:
                raise
            except asyncio.CancelledError:
                self.metrics.request_failure.labels("cancelled").inc()
                raise
            except Exception as e:
                await fail(self, context, e)

        return wrapper

    return decorate


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    """The RPC handlers. Runs on one event loop; `worker` runs the engine."""

    def __init__(
        self,
        worker: EngineWorker,
        tokenizer: PreTrainedTokenizerBase,
        limits: Limits,
        metrics: ServerMetrics,
        max_concurrent_requests: int,
        default_include_stop_seqs: bool = True,
        output_special_tokens: bool = False,
    ) -> None:
        self.worker = worker
        self.tokenizer = tokenizer
        self.limits = limits
        self.metrics = metrics
        self.max_concurrent_requests = max_concurrent_requests
        self.default_include_stop_seqs = default_include_stop_seqs
        self.skip_special_tokens = not output_special_tokens
        self._in_flight = 0
        bos = tokenizer.bos_token_id
        probe = list(tokenizer("a")["input_ids"])
        self._bos_id: int | None = bos if probe and probe[0] == bos else None
        fallback = bos if bos is not None else tokenizer.eos_token_id
        self._empty_prompt = [fallback if fallback is not None else 0]

    @contextmanager
    def _admit(self, n: int) -> Iterator[None]:
        if self._in_flight + n > self.max_concurrent_requests:
            raise Overloaded(OVERLOADED_MSG)
        self._in_flight += n
        try:
            yield
        finally:
            self._in_flight -= n

    def _prepare(self, text: str, params: DecodingParams) -> PreparedInput:
        try:
            ids = list(self.tokenizer(text)["input_ids"])
        except Exception as e:
            raise tokenizer_error(str(e)) from e
        self.metrics.request_input_length.observe(len(ids))
        validated = validate_input(params, len(ids), self.limits)
        truncate = validated.params.truncate_input_tokens
        if truncate:
            ids = ids[-truncate:]
            if self._bos_id is not None:
                ids[0] = self._bos_id
        self.metrics.request_max_new_tokens.observe(validated.params.max_new_tokens)
        prompt = ids or list(self._empty_prompt)
        return PreparedInput(text, ids, prompt, validated.input_length, validated.params)

    def _tracker(self, inp: PreparedInput) -> OutputTracker:
        include = inp.params.include_stop_sequence
        return OutputTracker(
            self.tokenizer,
            inp.prompt_token_ids,
            inp.params,
            self.default_include_stop_seqs if include is None else include,
            self.skip_special_tokens,
        )

    def _start(self, inputs: Sequence[PreparedInput], arrival: float) -> list[_Job]:
        loop = asyncio.get_running_loop()
        jobs = [_Job(self.worker, self._tracker(inp)) for inp in inputs]
        submissions = []
        for job, inp in zip(jobs, inputs, strict=True):
            limit_ms = inp.params.time_limit_millis
            time_limit = None
            if limit_ms:
                time_limit = max(0.0, limit_ms / 1000 - (time.monotonic() - arrival))
            sink = functools.partial(_deliver, loop, job.queue)
            params = convert.sampling_params(inp.params)
            submissions.append(
                Submission(job.request_id, inp.prompt_token_ids, params, time_limit, sink)
            )
        self.worker.submit(submissions)
        return jobs

    def _record_success(self, kind: str, inp: PreparedInput, last: OutputChunk, t0: float) -> None:
        m = self.metrics
        m.request_success.labels(pb.StopReason.Name(last.stop_reason), kind).inc()
        m.request_generated_tokens.observe(last.generated_token_count)
        m.request_total_tokens.observe(inp.input_token_count + last.generated_token_count)
        elapsed = time.monotonic() - t0
        m.request_duration.observe(elapsed)
        if last.generated_token_count:
            m.request_mean_time_per_token_duration.observe(elapsed / last.generated_token_count)

    @handle_errors("batch")
    async def Generate(
        self, request: pb.BatchedGenerationRequest, context: grpc.aio.ServicerContext
    ) -> pb.BatchedGenerationResponse:
        if not request.requests:
            return pb.BatchedGenerationResponse()
        t0 = time.monotonic()
        kind = "batch" if len(request.requests) > 1 else "single"
        self.metrics.request_count.labels(kind).inc()
        self.metrics.request_input_count.inc(len(request.requests))
        with self._admit(len(request.requests)):
            params = request_parameters(request, self.limits)
            _check_prefix(request)
            inputs = [self._prepare(r.text, params) for r in request.requests]
            self.metrics.request_validation_duration.observe(time.monotonic() - t0)
            jobs = self._start(inputs, t0)
            try:
                results = await asyncio.gather(*(job.collect() for job in jobs))
            finally:
                for job in jobs:
                    job.cancel()
        response = pb.BatchedGenerationResponse()
        for inp, job, chunks in zip(inputs, jobs, results, strict=True):
            self._record_success(kind, inp, chunks[-1], t0)
            input_text = inp.text if inp.params.input_text else ""
            seed = inp.params.seed or 0
            input_tokens = []
            if inp.params.input_tokens:
                input_tokens = job.tracker.input_tokens(inp.input_token_ids)
            response.responses.append(
                convert.unary_response(
                    chunks, inp.input_token_count, input_text, seed, input_tokens
                )
            )
        return response

    @handle_errors("stream")
    async def GenerateStream(
        self, request: pb.SingleGenerationRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerationResponse]:
        t0 = time.monotonic()
        self.metrics.request_count.labels("stream").inc()
        self.metrics.request_input_count.inc()
        with self._admit(1):
            params = request_parameters(request, self.limits)
            _check_prefix(request)
            inp = self._prepare(request.request.text, params)
            self.metrics.request_validation_duration.observe(time.monotonic() - t0)
            seed = inp.params.seed or 0
            input_text = inp.text if inp.params.input_text else ""
            (job,) = self._start([inp], t0)
            try:
                yield convert.first_stream_message(inp.input_token_count, input_text, seed)
                inputs_pending = inp.params.input_tokens
                async for chunk in job.chunks():
                    if inputs_pending:
                        inputs_pending = False
                        details = job.tracker.input_tokens(inp.input_token_ids)
                        yield convert.input_tokens_message(inp.input_token_count, details)
                    if chunk.text or chunk.tokens or chunk.finished:
                        yield convert.stream_message(chunk, seed)
                    if chunk.finished:
                        self._record_success("stream", inp, chunk, t0)
            finally:
                job.cancel()

    async def Tokenize(
        self, request: pb.BatchedTokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.BatchedTokenizeResponse:
        t0 = time.monotonic()
        self.metrics.tokenize_request_count.inc()
        self.metrics.tokenize_request_input_count.inc(len(request.requests))
        response = pb.BatchedTokenizeResponse()
        total = 0
        for r in request.requests:
            try:
                enc = self.tokenizer(r.text, return_offsets_mapping=request.return_offsets)
            except Exception as e:
                await context.abort(grpc.StatusCode.UNKNOWN, str(e))
            ids = list(enc["input_ids"])
            offsets = [tuple(o) for o in enc["offset_mapping"]] if request.return_offsets else None
            keep = request.truncate_input_tokens
            if 0 < keep < len(ids):
                ids = ids[-keep:]
                offsets = offsets[-keep:] if offsets is not None else None
            tokens = self.tokenizer.convert_ids_to_tokens(ids) if request.return_tokens else None
            total += len(ids)
            response.responses.append(convert.tokenize_response(len(ids), tokens, offsets))
        self.metrics.tokenize_request_tokens.observe(total)
        self.metrics.tokenize_request_duration.observe(time.monotonic() - t0)
        return response

    async def ModelInfo(
        self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfoResponse:
        return convert.model_info_response(
            self.limits.max_sequence_length, self.limits.max_new_tokens
        )


def _check_prefix(request: pb.BatchedGenerationRequest | pb.SingleGenerationRequest) -> None:
    """Prompt prefixes (PREFIX_STORE_PATH) are not supported: every prefix_id is unknown."""
    if request.HasField("prefix_id"):
        reason = prefix_not_found_reason(request.prefix_id)
        raise prefix_lookup_error(request.prefix_id, reason)


def _deliver(
    loop: asyncio.AbstractEventLoop,
    q: asyncio.Queue[EngineOutput | BaseException],
    item: EngineOutput | BaseException,
) -> None:
    with contextlib.suppress(RuntimeError):  # a closed loop: the server is gone
        loop.call_soon_threadsafe(q.put_nowait, item)


class _Job:
    """One engine request seen from the event loop: its output queue and tracker."""

    def __init__(self, worker: EngineWorker, tracker: OutputTracker) -> None:
        self.request_id = uuid.uuid4().hex
        self.queue: asyncio.Queue[EngineOutput | BaseException] = asyncio.Queue()
        self.tracker = tracker
        self._worker = worker
        self._done = False

    async def chunks(self) -> AsyncIterator[OutputChunk]:
        """The request's chunks up to the finished one; raises GenerationError on failure."""
        while not self.tracker.finished:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                self._done = True
                raise item
            if item.finished:
                self._done = True
            for chunk in self.tracker.add(item):
                yield chunk

    async def collect(self) -> list[OutputChunk]:
        return [chunk async for chunk in self.chunks()]

    def cancel(self) -> None:
        """Abort the engine request unless the engine already finished it."""
        if not self._done:
            self._done = True
            self._worker.abort(self.request_id)
