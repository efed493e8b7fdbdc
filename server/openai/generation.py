"""One generation request of the HTTP API on the shared `RequestRunner`: its admission permits
(one per choice), its inputs (prepared on the tokenization pool, n choices per prompt), its
engine jobs, and the metrics and span the gRPC API writes for its RPCs. Protocol-neutral: the
completions and chat modules format what it yields."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from opentelemetry.trace import Span

from server.convert import OutputChunk
from server.input_preparer import InputPreparer, PreparedInput
from server.job import Job
from server.messages import ValidationError, tokenizer_error
from server.openai.errors import ApiError, from_exception
from server.openai.sampling import Sampling
from server.request_runner import RequestRunner
from server.tracing import Metadata, http_span
from server.validation import Limits, check_input_size

T = TypeVar("T")

MERGE_BUFFER = 16
"""Chunks of a request's several choices waiting to be written, at most (per request)."""


@dataclass(frozen=True)
class Prompt:
    """One prompt: its text, and its token ids when the client sent ids (else tokenized from
    the text, with the tokenizer's special tokens when `add_special_tokens`)."""

    text: str | None
    token_ids: list[int] | None = None
    add_special_tokens: bool = True


def prepare(
    preparer: InputPreparer,
    prompts: Callable[[], Sequence[Prompt]],
    sampling: Sampling,
    limits: Limits,
    vocab_size: int,
) -> list[PreparedInput]:
    """Every choice's input, prompt-major (on the tokenization pool): `prompts()` made, each
    tokenized once (or its ids checked against `vocab_size` and decoded), checked as the gRPC
    API checks an input, and given its choice's seed."""
    inputs = []
    for p, prompt in enumerate(prompts()):
        ids = prompt.token_ids
        text = prompt.text
        if ids is not None:
            if any(not 0 <= i < vocab_size for i in ids):
                raise ValidationError(f"input tokens must be token ids below {vocab_size}")
            if text is None:
                text = str(preparer.tokenizer.decode(ids))
        else:
            assert text is not None
            check_input_size(text, limits)
            try:
                encoded = preparer.tokenizer(text, add_special_tokens=prompt.add_special_tokens)
            except Exception as e:
                raise tokenizer_error(str(e)) from e
            ids = list(encoded["input_ids"])
        for c in range(sampling.n):
            params = sampling.for_choice(p * sampling.n + c)
            inputs.append(preparer.prepare_tokens(text, list(ids), params))
    return inputs


class Generation:
    """A request of `kind` (a `tgi_request_count` kind) at `route`, from arrival to its last
    chunk. `open` admits, prepares and starts it (an ApiError for what fails first); `close`
    cancels what still runs and releases everything, whatever happened; it is idempotent."""

    def __init__(
        self,
        runner: RequestRunner,
        kind: str,
        route: str,
        headers: Metadata,
        prompt_param: str,
        top_param: str,
        vocab_size: int,
    ) -> None:
        self.runner = runner
        self.kind = kind
        self.route = route
        self.arrival = time.monotonic()
        self.inputs: list[PreparedInput] = []
        self.jobs: list[Job] = []
        self.finished = 0
        self._params = (prompt_param, top_param)
        self._vocab_size = vocab_size
        self._stack = contextlib.ExitStack()
        self.span: Span = self._stack.enter_context(http_span(runner.tracer, route, headers))
        runner.metrics.request_count.labels(kind).inc()

    async def open(
        self, num_prompts: int, prompts: Callable[[], Sequence[Prompt]], sampling: Sampling
    ) -> None:
        """Admit the request (n permits for each of its `num_prompts` prompts), make its
        `prompts()`, prepare its inputs and start them."""
        metrics = self.runner.metrics
        try:
            count = num_prompts * sampling.n
            metrics.request_input_count.inc(count)
            self.span.set_attribute("request.inputs", count)
            self._stack.enter_context(self.runner.admit(count))
            self.inputs = await self.runner.off_loop(
                prepare,
                self.runner.inputs,
                prompts,
                sampling,
                self.runner.limits,
                self._vocab_size,
            )
            validation = time.monotonic() - self.arrival
            metrics.request_validation_duration.observe(validation)
            self.span.set_attribute("validation_time_s", validation)
            engine = [sampling.engine_params(inp.params) for inp in self.inputs]
            self.jobs = self.runner.start(self.inputs, self.arrival, engine)
        except Exception as e:
            raise self.fail(e) from None
        except BaseException:
            self.close()
            raise

    def check(self, step: Callable[[], T]) -> T:
        """`step()`, its exception counted and closing the request as `fail` does."""
        try:
            return step()
        except Exception as e:
            raise self.fail(e) from None

    def fail(self, e: Exception) -> ApiError:
        """The error response for `e`, counted as a failure; closes the request."""
        error = from_exception(e, *self._params)
        if error.err is not None:
            self.runner.metrics.request_failure.labels(error.err).inc()
        self.finished = len(self.jobs)
        self.span.set_attribute("http.response.status_code", error.status)
        self.close()
        return error

    def succeeded(self, index: int, last: OutputChunk) -> None:
        """Count choice `index` finished with `last`."""
        job = self.jobs[index]
        self.runner.record_success(self.kind, self.inputs[index], last, job, self.span, index)
        self.finished += 1

    def close(self) -> None:
        """Cancel unfinished jobs (counted as cancelled when none failed) and release the
        permits and the span."""
        for job in self.jobs:
            job.cancel()
        if self.jobs and self.finished < len(self.jobs):
            self.runner.metrics.request_failure.labels("cancelled").inc()
            self.finished = len(self.jobs)
        self._stack.close()

    async def collect(self) -> list[list[OutputChunk]]:
        """Every choice's chunks, once all finished (raises ApiError on a failure)."""
        try:
            results = await asyncio.gather(*(job.collect() for job in self.jobs))
        except Exception as e:
            raise self.fail(e) from None
        for i, chunks in enumerate(results):
            self.succeeded(i, chunks[-1])
        return results

    async def batches(self) -> AsyncIterator[list[tuple[int, OutputChunk]]]:
        """(choice index, chunk) pairs as the choices produce them, interleaved, in groups of
        what was ready together; counts each finished choice. Raises ApiError on a failure."""
        try:
            async for batch in _merged(self.jobs):
                for index, chunk in batch:
                    if chunk.finished:
                        self.succeeded(index, chunk)
                yield batch
        except Exception as e:
            raise self.fail(e) from None


async def _merged(jobs: Sequence[Job]) -> AsyncIterator[list[tuple[int, OutputChunk]]]:
    if len(jobs) == 1:
        async for chunks in jobs[0].chunk_batches():
            yield [(0, chunk) for chunk in chunks]
        return
    queue: asyncio.Queue[tuple[int, OutputChunk | BaseException | None]]
    queue = asyncio.Queue(MERGE_BUFFER)

    async def pump(index: int, job: Job) -> None:
        try:
            async for chunk in job.chunks():
                await queue.put((index, chunk))
        except Exception as e:
            await queue.put((index, e))
        await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        running = len(jobs)
        while running:
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            batch = []
            for index, item in items:
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    batch.append((index, item))
            if batch:
                yield batch
    finally:
        for task in tasks:
            task.cancel()
