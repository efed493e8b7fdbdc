"""`fmaas.GenerationService` on grpc.aio, over an `LLMEngine` running on its own thread.

Three layers, each protobuf-free except the servicer:

- `server.engine_worker.EngineWorker` owns the engine thread and delivers each request's
  `EngineOutput`s to a sink; here the sink puts them on the request's asyncio queue.
- `server.output_tracker.OutputTracker` is TGIS's router logic for one input: UTF-8-safe
  incremental detokenization, stop sequences on the decoded text, the TGIS stop reason,
  split into `OutputChunk`s.
- `server.input_preparer.InputPreparer` tokenizes, validates and truncates each input and looks
  up its prompt prefix.
- `GenerationServicer` is the thin RPC layer: admission (MAX_CONCURRENT_REQUESTS), request
  validation, and `server.convert` for every message; `server.job.Job` is one engine
  request seen from the event loop, and `server.status.handle_errors` maps exceptions to
  status codes.

No request can harm another: tokenization (Generate and Tokenize) runs on a thread pool, not on
the event loop; Tokenize takes admission permits like Generate; every response message is at
most `max_response_bytes` (below gRPC's default 4 MiB receive limit), else the request fails
with RESOURCE_EXHAUSTED; error messages quote user text clipped; `server.decode_guard` answers
undecodable request bytes with INVALID_ARGUMENT and a rate-limited warning, and request fields
unknown to this proto get INVALID_ARGUMENT too. With OTLP_ENDPOINT, `server.tracing` writes a
span per RPC and per generated sequence.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

import grpc
from opentelemetry.trace import Span
from transformers import PreTrainedTokenizerBase

from server import convert
from server.config import DEFAULT_MAX_RESPONSE_BYTES
from server.convert import OutputChunk
from server.engine_worker import EngineWorker, Submission
from server.errors import Overloaded, SizeBound, TokenizerFailure
from server.input_preparer import InputPreparer, PreparedInput
from server.job import Job, deliver
from server.messages import clip
from server.metrics import ServerMetrics
from server.output_tracker import OutputTracker
from server.pb import generation_pb2 as pb
from server.pb import generation_pb2_grpc
from server.prefix_store import PrefixStore
from server.proto_fields import check_known_fields
from server.status import handle_errors
from server.tracing import RequestTracer, SequenceRecord, rpc_span
from server.validation import (
    Limits,
    check_input_size,
    request_parameters,
)

T = TypeVar("T")

OVERLOADED_MSG = "Model is overloaded"


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    """The RPC handlers. Runs on one event loop; `worker` runs the engine; tokenization runs on
    a pool of `tokenization_workers` threads (default: min(8, CPUs)); `close()` stops it. With a
    `tracer`, each RPC and each generated sequence gets a span (`server.tracing`). A request's
    `prefix_id` is looked up in `prefixes` on the same pool (without a store, every id is not
    found, a `tgi_prompt_load_failure`); its virtual tokens count toward the input length."""

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
        tracer: RequestTracer | None = None,
        prefixes: PrefixStore | None = None,
    ) -> None:
        self.worker = worker
        self.tracer = tracer
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
        self._inputs = InputPreparer(tokenizer, limits, metrics, prefixes)

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

    def _tracker(self, inp: PreparedInput) -> OutputTracker:
        include = inp.params.include_stop_sequence
        return OutputTracker(
            self.tokenizer,
            inp.prompt_token_ids,
            inp.params,
            self.default_include_stop_seqs if include is None else include,
            self.skip_special_tokens,
        )

    def _start(self, inputs: Sequence[PreparedInput], arrival: float) -> list[Job]:
        loop = asyncio.get_running_loop()
        jobs = [Job(self.worker, self._tracker(inp), arrival) for inp in inputs]
        submissions = []
        for job, inp in zip(jobs, inputs, strict=True):
            limit_ms = inp.params.time_limit_millis
            time_limit = None
            if limit_ms:
                time_limit = max(0.0, limit_ms / 1000 - (time.monotonic() - arrival))
            sink = functools.partial(deliver, loop, job.queue)
            params = convert.sampling_params(inp.params)
            submissions.append(
                Submission(
                    job.request_id,
                    inp.prompt_token_ids,
                    params,
                    time_limit,
                    sink,
                    job.timing,
                    inp.prompt_prefix,
                )
            )
        self.worker.submit(submissions)
        return jobs

    def _record_success(
        self,
        kind: str,
        inp: PreparedInput,
        last: OutputChunk,
        job: Job,
        span: Span,
        index: int = 0,
    ) -> None:
        """Count a completed input: success, token counts, end-to-end duration and, once the
        engine ran it, inference duration (first step to now) and its time per token; with a
        tracer, write its `sequence` span under the RPC's `span`."""
        m = self.metrics
        stop_reason = pb.StopReason.Name(last.stop_reason)
        m.request_success.labels(stop_reason, kind).inc()
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
        if self.tracer is not None:
            record = SequenceRecord(
                index=index,
                input_tokens=inp.input_token_count,
                generated_tokens=last.generated_token_count,
                max_new_tokens=inp.params.max_new_tokens,
                stop_reason=stop_reason,
                decoding_method="greedy" if inp.params.greedy else "sample",
                seed=inp.params.seed or 0,
                arrival=job.timing.arrival,
                started=started,
                first_token=job.timing.first_token,
                end=now,
            )
            self.tracer.sequence(span, record)

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
        with rpc_span(self.tracer, "Generate", context.invocation_metadata()) as span:
            span.set_attribute("request.inputs", len(request.requests))
            with self._admit(len(request.requests)):
                params = request_parameters(request, self.limits)
                texts = [r.text for r in request.requests]
                for text in texts:
                    check_input_size(text, self.limits)
                prefix_id = request.prefix_id if request.HasField("prefix_id") else None
                inputs = await self._off_loop(self._inputs.prepare_all, texts, params, prefix_id)
                validation = time.monotonic() - t0
                self.metrics.request_validation_duration.observe(validation)
                span.set_attribute("validation_time_s", validation)
                jobs = self._start(inputs, t0)
                try:
                    results = await asyncio.gather(*(job.collect() for job in jobs))
                finally:
                    for job in jobs:
                        job.cancel()
            response = pb.BatchedGenerationResponse()
            bound = SizeBound(self.max_response_bytes)
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
            for i, (inp, job, chunks) in enumerate(zip(inputs, jobs, results, strict=True)):
                self._record_success(kind, inp, chunks[-1], job, span, i)
            return response

    @handle_errors("stream")
    async def GenerateStream(
        self, request: pb.SingleGenerationRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerationResponse]:
        t0 = time.monotonic()
        self.metrics.request_count.labels("stream").inc()
        self.metrics.request_input_count.inc()
        with (
            rpc_span(self.tracer, "GenerateStream", context.invocation_metadata()) as span,
            self._admit(1),
        ):
            params = request_parameters(request, self.limits)
            check_input_size(request.request.text, self.limits)
            prefix_id = request.prefix_id if request.HasField("prefix_id") else None
            (inp,) = await self._off_loop(
                self._inputs.prepare_all, [request.request.text], params, prefix_id
            )
            validation = time.monotonic() - t0
            self.metrics.request_validation_duration.observe(validation)
            span.set_attribute("validation_time_s", validation)
            seed = inp.params.seed or 0
            input_text = inp.text if inp.params.input_text else ""
            bound = SizeBound(self.max_response_bytes)
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
                        self._record_success("stream", inp, chunk, job, span)
            finally:
                job.cancel()

    @handle_errors("tokenize")
    async def Tokenize(
        self, request: pb.BatchedTokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.BatchedTokenizeResponse:
        """Admitted like Generate (one permit per input); each text is at most
        `limits.max_input_bytes`; `truncate_input_tokens` N > 0 keeps the last N tokens (and
        their offsets), as TGIS. Fields this server does not know (vllm-tgis-adapter's
        adapter_id, say) fail with INVALID_ARGUMENT."""
        t0 = time.monotonic()
        self.metrics.tokenize_request_count.inc()
        self.metrics.tokenize_request_input_count.inc(len(request.requests))
        if not request.requests:
            return pb.BatchedTokenizeResponse()
        with (
            rpc_span(self.tracer, "Tokenize", context.invocation_metadata()) as span,
            self._admit(len(request.requests)),
        ):
            span.set_attribute("request.inputs", len(request.requests))
            check_known_fields(request)
            for r in request.requests:
                check_input_size(r.text, self.limits)
            response, total = await self._off_loop(self._tokenize, request)
            span.set_attribute("input_tokens", total)
        self.metrics.tokenize_request_tokens.observe(total)
        self.metrics.tokenize_request_duration.observe(time.monotonic() - t0)
        return response

    def _tokenize(
        self, request: pb.BatchedTokenizeRequest
    ) -> tuple[pb.BatchedTokenizeResponse, int]:
        """The Tokenize response and its total token count (on the tokenization pool)."""
        response = pb.BatchedTokenizeResponse()
        bound = SizeBound(self.max_response_bytes)
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
