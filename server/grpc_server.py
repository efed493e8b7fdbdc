"""`fmaas.GenerationService` on grpc.aio, over an `LLMEngine` running on its own thread.

Three layers, each protobuf-free except the servicer:

- `server.engine_worker.EngineWorker` owns the engine thread and delivers each request's
  `EngineOutput`s to a sink; here the sink puts them on the request's asyncio queue.
- `server.output_tracker.OutputTracker` is TGIS's router logic for one input: UTF-8-safe
  incremental detokenization, stop sequences on the decoded text, the TGIS stop reason,
  split into `OutputChunk`s.
- `server.input_preparer.InputPreparer` tokenizes, validates and truncates each input and looks
  up its prompt prefix.
- `server.request_runner.RequestRunner` is the path both APIs share: admission
  (MAX_CONCURRENT_REQUESTS, counted across gRPC and HTTP), the tokenization pool, engine jobs,
  success metrics and sequence spans.
- `GenerationServicer` is the thin RPC layer: request validation and `server.convert` for every
  message; `server.job.Job` is one engine request seen from the event loop, and
  `server.status.handle_errors` maps exceptions to status codes.

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
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import grpc
from opentelemetry.trace import Span

from server import convert
from server.config import DEFAULT_MAX_RESPONSE_BYTES
from server.convert import OutputChunk
from server.errors import SizeBound, TokenizerFailure
from server.input_preparer import PreparedInput
from server.job import Job
from server.messages import clip
from server.pb import generation_pb2 as pb
from server.pb import generation_pb2_grpc
from server.proto_fields import check_known_fields
from server.request_runner import RequestRunner
from server.status import handle_errors
from server.tracing import rpc_span
from server.validation import check_input_size, request_parameters

T = TypeVar("T")


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    """The RPC handlers over `runner` (admission, tokenization pool, engine jobs, metrics and
    spans, shared with the HTTP API). With a tracer, each RPC gets a span. A request's
    `prefix_id` is looked up by the runner's input preparer (without a store, every id is not
    found, a `tgi_prompt_load_failure`); its virtual tokens count toward the input length."""

    def __init__(
        self, runner: RequestRunner, max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    ) -> None:
        self.runner = runner
        self.worker = runner.worker
        self.tracer = runner.tracer
        self.tokenizer = runner.tokenizer
        self.limits = runner.limits
        self.metrics = runner.metrics
        self.max_response_bytes = max_response_bytes
        self._inputs = runner.inputs

    def close(self) -> None:
        """Stop the tokenization threads (work already queued is dropped)."""
        self.runner.close()

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the tokenization pool."""
        return await self.runner.off_loop(fn, *args)

    def _admit(self, n: int) -> AbstractContextManager[None]:
        return self.runner.admit(n)

    def _start(self, inputs: Sequence[PreparedInput], arrival: float) -> list[Job]:
        return self.runner.start(inputs, arrival)

    def _record_success(
        self,
        kind: str,
        inp: PreparedInput,
        last: OutputChunk,
        job: Job,
        span: Span,
        index: int = 0,
    ) -> None:
        self.runner.record_success(kind, inp, last, job, span, index)

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
