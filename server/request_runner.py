"""`RequestRunner`: the request path the gRPC servicer and the OpenAI-compatible HTTP API share,
free of either protocol: admission (`server.admission`), input preparation on the tokenization
pool (`server.input_preparer`), submission to the engine thread as `server.job.Job`s, and the
success metrics and sequence spans of a completed input."""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

from opentelemetry.trace import Span
from transformers import PreTrainedTokenizerBase

from engine.sampling.params import SamplingParams
from server import convert
from server.admission import Admission
from server.convert import OutputChunk
from server.engine_worker import EngineWorker, Submission
from server.input_preparer import InputPreparer, PreparedInput
from server.job import Job, deliver
from server.metrics import ServerMetrics
from server.output_tracker import OutputTracker
from server.pb import generation_pb2 as pb
from server.prefix_store import PrefixStore
from server.tracing import RequestTracer, SequenceRecord
from server.validation import Limits

T = TypeVar("T")


class RequestRunner:
    """Runs requests on `worker` for any API on one event loop. Tokenization runs on a pool of
    `tokenization_workers` threads (default: min(8, CPUs)); `close()` stops it. With a
    `tracer`, each completed input gets a `sequence` span (`server.tracing`). A `prefix_id` is
    looked up in `prefixes` (see `InputPreparer`)."""

    def __init__(
        self,
        worker: EngineWorker,
        tokenizer: PreTrainedTokenizerBase,
        limits: Limits,
        metrics: ServerMetrics,
        max_concurrent_requests: int,
        default_include_stop_seqs: bool = True,
        output_special_tokens: bool = False,
        tokenization_workers: int | None = None,
        tracer: RequestTracer | None = None,
        prefixes: PrefixStore | None = None,
    ) -> None:
        self.worker = worker
        self.tokenizer = tokenizer
        self.limits = limits
        self.metrics = metrics
        self.tracer = tracer
        self.admission = Admission(max_concurrent_requests)
        self.default_include_stop_seqs = default_include_stop_seqs
        self.skip_special_tokens = not output_special_tokens
        workers = tokenization_workers or min(8, os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="tokenize")
        self.inputs = InputPreparer(tokenizer, limits, metrics, prefixes)

    def close(self) -> None:
        """Stop the tokenization threads (work already queued is dropped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the tokenization pool."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    @contextmanager
    def admit(self, n: int) -> Iterator[None]:
        """`n` permits of MAX_CONCURRENT_REQUESTS for the block (Overloaded beyond it)."""
        with self.admission.admit(n):
            yield

    def tracker(self, inp: PreparedInput) -> OutputTracker:
        include = inp.params.include_stop_sequence
        return OutputTracker(
            self.tokenizer,
            inp.prompt_token_ids,
            inp.params,
            self.default_include_stop_seqs if include is None else include,
            self.skip_special_tokens,
        )

    def start(
        self,
        inputs: Sequence[PreparedInput],
        arrival: float,
        engine_params: Sequence[SamplingParams] | None = None,
    ) -> list[Job]:
        """Submit `inputs` to the engine (in one step), one `Job` each; `engine_params`, when
        given, replaces `convert.sampling_params` of each input's parameters."""
        loop = asyncio.get_running_loop()
        jobs = [Job(self.worker, self.tracker(inp), arrival) for inp in inputs]
        submissions = []
        for i, (job, inp) in enumerate(zip(jobs, inputs, strict=True)):
            limit_ms = inp.params.time_limit_millis
            time_limit = None
            if limit_ms:
                time_limit = max(0.0, limit_ms / 1000 - (time.monotonic() - arrival))
            sink = functools.partial(deliver, loop, job.queue)
            if engine_params is None:
                params = convert.sampling_params(inp.params)
            else:
                params = engine_params[i]
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

    def record_success(
        self,
        kind: str,
        inp: PreparedInput,
        last: OutputChunk,
        job: Job,
        span: Span,
        index: int = 0,
    ) -> None:
        """Count a completed input of request `kind`: success, token counts, end-to-end
        duration and, once the engine ran it, inference duration (first step to now) and its
        time per token; with a tracer, write its `sequence` span under the request's `span`."""
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
