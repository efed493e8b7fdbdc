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

No request can harm another: tokenization (Generate and Tokenize) runs on a thread pool, not on
the event loop; Tokenize takes admission permits like Generate; every response message is at
most `max_response_bytes` (below gRPC's default 4 MiB receive limit), else the request fails
with RESOURCE_EXHAUSTED; error messages quote user text clipped; `RequestDecodeGuard` answers
undecodable request bytes with INVALID_ARGUMENT and a rate-limited warning.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import math
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from transformers import PreTrainedTokenizerBase

from engine.core import EngineOutput
from server import convert
from server.config import DEFAULT_MAX_RESPONSE_BYTES
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
    check_input_size,
    clip,
    prefix_lookup_error,
    prefix_not_found_reason,
    request_parameters,
    tokenizer_error,
    validate_input,
)

logger = logging.getLogger(__name__)

OVERLOADED_MSG = "Model is overloaded"
MAX_ERROR_MESSAGE_BYTES = 1024
"""Any error message is clipped to this (a status message travels in gRPC metadata)."""
DECODE_WARNING_INTERVAL_S = 10.0


class Overloaded(Exception):
    """More inputs in flight than MAX_CONCURRENT_REQUESTS allows (RESOURCE_EXHAUSTED)."""


class ResponseTooLarge(Exception):
    """A response message would exceed `max_response_bytes` (RESOURCE_EXHAUSTED)."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"the response would exceed {limit} bytes (MAX_RESPONSE_BYTES): request fewer token "
            "details (top_n_tokens, input_tokens), fewer or shorter inputs, or no offsets"
        )


class TokenizerFailure(Exception):
    """The tokenizer failed on a Tokenize input (UNKNOWN, the tokenizer's text, as TGIS)."""


class _SizeBound:
    """Running size of a message being assembled from parts; raises ResponseTooLarge past
    `limit`. Each part counts its serialized size plus its field tag and length prefix."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0

    def add(self, part: Any) -> None:
        n = int(part.ByteSize())
        self.size += n + 1 + max(1, math.ceil(n.bit_length() / 7))
        if self.size > self.limit:
            raise ResponseTooLarge(self.limit)

    def check(self, message: Any) -> Any:
        """`message` itself, if it is at most `limit` bytes."""
        if message.ByteSize() > self.limit:
            raise ResponseTooLarge(self.limit)
        return message


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
    RESOURCE_EXHAUSTED "Model is overloaded", ResponseTooLarge -> RESOURCE_EXHAUSTED,
    GenerationError, TokenizerFailure and anything else -> UNKNOWN (only the last logged with a
    traceback). Messages are clipped to MAX_ERROR_MESSAGE_BYTES. Counts each Generate failure in
    `tgi_request_failure` (a response too large as err="validation"), cancellations as
    err="cancelled"; `kind` "tokenize" counts nothing."""
    counted = kind != "tokenize"

    def decorate(fn: Any) -> Any:
        async def fail(
            self: GenerationServicer, context: grpc.aio.ServicerContext, e: Exception
        ) -> None:
            code, err, message = grpc.StatusCode.UNKNOWN, "unknown", str(e)
            if isinstance(e, ValidationError):
                code, err, message = grpc.StatusCode.INVALID_ARGUMENT, "validation", e.message
            elif isinstance(e, Overloaded):
                code, err, message = grpc.StatusCode.RESOURCE_EXHAUSTED, "conc_limit", str(e)
            elif isinstance(e, ResponseTooLarge):
                code, err = grpc.StatusCode.RESOURCE_EXHAUSTED, "validation"
            elif isinstance(e, GenerationError):
                err, message = "generate", f"Request failed during generation: {e}"
            elif not isinstance(e, TokenizerFailure):
                logger.exception("%s failed", fn.__name__)
            if counted:
                self.metrics.request_failure.labels(err).inc()
            await context.abort(code, clip(message, MAX_ERROR_MESSAGE_BYTES))

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
                        if counted:
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
                if counted:
                    self.metrics.request_failure.labels("cancelled").inc()
                raise
            except Exception as e:
                await fail(self, context, e)

        return wrapper

    return decorate


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    """The RPC handlers. Runs on one event loop; `worker` runs the engine; tokenization runs on
    a pool of `tokenization_workers` threads (default: min(8, CPUs)); `close()` stops it."""

    def __init__(
        self,
        worker: EngineWorker,
        tokenizer: PreTrainedTokenizerBase,
        limits: Limits,
        metrics: ServerMetrics,
        max_concurrent_requests: int,
        default_include_stop_seqs: bool = True,
        output_special_tokens: bool = False,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        tokenization_workers: int | None = None,
    ) -> None:
        self.worker = worker
        self.tokenizer = tokenizer
        self.limits = limits
        self.metrics = metrics
        self.max_concurrent_requests = max_concurrent_requests
        self.default_include_stop_seqs = default_include_stop_seqs
        self.skip_special_tokens = not output_special_tokens
        self.max_response_bytes = max_response_bytes
        workers = tokenization_workers or min(8, os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="tokenize")
        self._in_flight = 0
        bos = tokenizer.bos_token_id
        probe = list(tokenizer("a")["input_ids"])
        self._bos_id: int | None = bos if probe and probe[0] == bos else None
        fallback = bos if bos is not None else tokenizer.eos_token_id
        self._empty_prompt = [fallback if fallback is not None else 0]

    def close(self) -> None:
        """Stop the tokenization threads (work already queued is dropped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the tokenization pool."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    @contextmanager
    def _admit(self, n: int) -> Iterator[None]:
        if self._in_flight + n > self.max_concurrent_requests:
            raise Overloaded(OVERLOADED_MSG)
        self._in_flight += n
        try:
            yield
        finally:
            self._in_flight -= n

    def _prepare_all(self, texts: Sequence[str], params: DecodingParams) -> list[PreparedInput]:
        """`_prepare` each input in order (on the tokenization pool); the first failure raises."""
        return [self._prepare(text, params) for text in texts]

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
            texts = [r.text for r in request.requests]
            for text in texts:
                check_input_size(text, self.limits)
            inputs = await self._off_loop(self._prepare_all, texts, params)
            self.metrics.request_validation_duration.observe(time.monotonic() - t0)
            jobs = self._start(inputs, t0)
            try:
                results = await asyncio.gather(*(job.collect() for job in jobs))
            finally:
                for job in jobs:
                    job.cancel()
        response = pb.BatchedGenerationResponse()
        bound = _SizeBound(self.max_response_bytes)
        for inp, job, chunks in zip(inputs, jobs, results, strict=True):
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
            bound.add(response.responses[-1])
        for inp, job, chunks in zip(inputs, jobs, results, strict=True):
            self._record_success(kind, inp, chunks[-1], job)
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
            check_input_size(request.request.text, self.limits)
            inp = await self._off_loop(self._prepare, request.request.text, params)
            self.metrics.request_validation_duration.observe(time.monotonic() - t0)
            seed = inp.params.seed or 0
            input_text = inp.text if inp.params.input_text else ""
            bound = _SizeBound(self.max_response_bytes)
            (job,) = self._start([inp], t0)
            try:
                first = convert.first_stream_message(inp.input_token_count, input_text, seed)
                yield bound.check(first)
                inputs_pending = inp.params.input_tokens
                async for chunk in job.chunks():
                    if inputs_pending:
                        inputs_pending = False
                        details = job.tracker.input_tokens(inp.input_token_ids)
                        message = convert.input_tokens_message(inp.input_token_count, details)
                        yield bound.check(message)
                    if chunk.text or chunk.tokens or chunk.finished:
                        yield bound.check(convert.stream_message(chunk, seed))
                    if chunk.finished:
                        self._record_success("stream", inp, chunk, job)
            finally:
                job.cancel()

    @handle_errors("tokenize")
    async def Tokenize(
        self, request: pb.BatchedTokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.BatchedTokenizeResponse:
        """Admitted like Generate (one permit per input); each text is at most
        `limits.max_input_bytes`; `truncate_input_tokens` N > 0 keeps the last N tokens (and
        their offsets), as TGIS."""
        t0 = time.monotonic()
        self.metrics.tokenize_request_count.inc()
        self.metrics.tokenize_request_input_count.inc(len(request.requests))
        if not request.requests:
            return pb.BatchedTokenizeResponse()
        with self._admit(len(request.requests)):
            for r in request.requests:
                check_input_size(r.text, self.limits)
            response, total = await self._off_loop(self._tokenize, request)
        self.metrics.tokenize_request_tokens.observe(total)
        self.metrics.tokenize_request_duration.observe(time.monotonic() - t0)
        return response

    def _tokenize(
        self, request: pb.BatchedTokenizeRequest
    ) -> tuple[pb.BatchedTokenizeResponse, int]:
        """The Tokenize response and its total token count (on the tokenization pool)."""
        response = pb.BatchedTokenizeResponse()
        bound = _SizeBound(self.max_response_bytes)
        total = 0
        for r in request.requests:
            try:
                enc = self.tokenizer(r.text, return_offsets_mapping=request.return_offsets)
            except Exception as e:
                raise TokenizerFailure(clip(str(e))) from e
            ids = list(enc["input_ids"])
            offsets = [tuple(o) for o in enc["offset_mapping"]] if request.return_offsets else None
            keep = request.truncate_input_tokens
            if 0 < keep < len(ids):
                ids = ids[-keep:]
                offsets = offsets[-keep:] if offsets is not None else None
            tokens = self.tokenizer.convert_ids_to_tokens(ids) if request.return_tokens else None
            total += len(ids)
            response.responses.append(convert.tokenize_response(len(ids), tokens, offsets))
            bound.add(response.responses[-1])
        return response, total

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


class _Undecodable:
    """What the guarded deserializer returns for bytes that are not a valid request message."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


class _RateLimitedWarning:
    """Logs a WARNING at most once per `interval_s`, counting the occurrences it held back."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last = -math.inf
        self._held_back = 0

    def warn(self, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self._held_back += 1
            return
        if self._held_back:
            message += f" ({self._held_back} more in the previous {self.interval_s:.0f} s)"
        logger.warning(message, *args)
        self._last, self._held_back = now, 0


class RequestDecodeGuard(grpc.aio.ServerInterceptor):
    """Answers request bytes that do not decode (malformed protobuf, invalid UTF-8 in a string)
    with INVALID_ARGUMENT ``malformed request message: ...`` and at most one WARNING line per
    `interval_s`. Left alone, grpc.aio raises in its deserializer, logs a traceback per message
    and answers UNKNOWN. Applies to unary-request methods (streamed requests pass through)."""

    def __init__(self, interval_s: float = DECODE_WARNING_INTERVAL_S) -> None:
        self._warning = _RateLimitedWarning(interval_s)
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method = str(handler_call_details.method)
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(method, handler)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        deserialize = handler.request_deserializer

        def guarded(data: bytes) -> Any:
            try:
                return deserialize(data)
            except Exception as e:
                return _Undecodable(f"{type(e).__name__}: {e}")

        async def reject(request: _Undecodable, context: grpc.aio.ServicerContext) -> None:
            self._warning.warn("undecodable request to %s: %s", method, clip(request.error))
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"malformed request message: {clip(request.error)}",
            )

        serialize = handler.response_serializer
        if not handler.response_streaming:
            inner = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Undecodable):
                    await reject(request, context)
                result = inner(request, context)
                return await result if inspect.isawaitable(result) else result

            return grpc.unary_unary_rpc_method_handler(unary, guarded, serialize)
        inner_stream = handler.unary_stream
        if inspect.iscoroutinefunction(inner_stream):  # the reader/writer API

            async def writer(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Undecodable):
                    await reject(request, context)
                return await inner_stream(request, context)

            return grpc.unary_stream_rpc_method_handler(writer, guarded, serialize)
        if inspect.isasyncgenfunction(inner_stream):

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                if isinstance(request, _Undecodable):
                    await reject(request, context)
                async for item in inner_stream(request, context):
                    yield item

            return grpc.unary_stream_rpc_method_handler(stream, guarded, serialize)
        return handler  # a synchronous generator: left to grpc
