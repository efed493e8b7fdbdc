"""`fmaas.GenerationService` on grpc.aio, over an `LLMEngine` running on its own thread.

Three layers, each protobuf-free except the servicer:

- `server.engine_worker.EngineWorker` owns the engine thread and delivers each request's
  `EngineOutput`s to a sink; here the sink puts them on the request's asyncio queue.
- `server.detokenize.OutputTracker` is TGIS's router logic for one input: UTF-8-safe
  incremental detokenization, stop sequences on the decoded text (§4.5), the TGIS stop reason,
  split into `OutputChunk`s.
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
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from transformers import PreTrainedTokenizerBase

from engine.core import EngineOutput
from server import convert
from server.convert import OutputChunk
from server.engine_worker import EngineWorker, RequestTiming, Submission
from server.errors import GenerationError
from server.metrics import ServerMetrics
from server.output_tracker import OutputTracker
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
                async with contextlib.aclosing(fn(self, request, context)) as stream:
                    try:
                        async for item in stream:
                            yield item
                    except grpc.aio.AbortError:
                        raise
                    except (asyncio.CancelledError, GeneratorExit):
                        # GeneratorExit: the client went away while the stream was suspended
                        # at a yield, and grpc closed it; aclosing() cancels the job now.
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
        self.metrics.request_raw_input_length.observe(len(ids))
        validated = validate_input(params, len(ids), self.limits)
        self.metrics.request_input_length.observe(validated.input_length)
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
        jobs = [_Job(self.worker, self._tracker(inp), arrival) for inp in inputs]
        submissions = []
        for job, inp in zip(jobs, inputs, strict=True):
            limit_ms = inp.params.time_limit_millis
            time_limit = None
            if limit_ms:
                time_limit = max(0.0, limit_ms / 1000 - (time.monotonic() - arrival))
            sink = functools.partial(_deliver, loop, job.queue)
            params = convert.sampling_params(inp.params)
            submissions.append(
                Submission(
                    job.request_id, inp.prompt_token_ids, params, time_limit, sink, job.timing
                )
            )
        self.worker.submit(submissions)
        return jobs

    def _record_success(self, kind: str, inp: PreparedInput, last: OutputChunk, job: _Job) -> None:
        """Count a completed input: success, token counts, end-to-end duration and, once the
        engine ran it, inference duration (first step to now) and its time per token."""
        m = self.metrics
        m.request_success.labels(pb.StopReason.Name(last.stop_reason), kind).inc()
        m.request_generated_tokens.observe(last.generated_token_count)
        m.request_total_tokens.observe(inp.input_token_count + last.generated_token_count)
        now = time.monotonic()
        m.request_duration.observe(now - job.timing.arrival)
        started = job.timing.started
        if started is not None:
            inference = now - started
            m.request_inference_duration.observe(inference)
            if last.generated_token_count:
                m.request_mean_time_per_token_duration.observe(
                    inference / last.generated_token_count
                )

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
            self._record_success(kind, inp, chunks[-1], job)
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
                        self._record_success("stream", inp, chunk, job)
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
    """One engine request seen from the event loop: its output queue, tracker and timing
    (`arrival` is when the RPC arrived)."""

    def __init__(self, worker: EngineWorker, tracker: OutputTracker, arrival: float) -> None:
        self.request_id = uuid.uuid4().hex
        self.timing = RequestTiming(arrival)
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
