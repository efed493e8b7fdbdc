"""Server-Sent Events for streamed responses, and what completions and chat share in their
bodies: ids, finish reasons, usage, token texts and logprob values.

Backpressure: each event is written with the ASGI server's `send`, which waits while the
connection's write buffer is above its high-water mark (uvicorn's flow control), so a client
that stops reading stops its stream's writer; what the engine produces meanwhile for its
request waits in the request's queue, at most its max_tokens tokens."""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send
from transformers import PreTrainedTokenizerBase

from server.convert import OutputChunk
from server.input_preparer import PreparedInput
from server.openai.errors import ApiError
from server.openai.generation import Generation
from server.pb import generation_pb2 as pb

MIN_LOGPROB = -9999.0
"""A logprob of -inf (a token the sampling rules excluded), as JSON has no infinity."""
_LENGTH = (pb.MAX_TOKENS, pb.TOKEN_LIMIT, pb.TIME_LIMIT)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def created() -> int:
    return int(time.time())


def finish_reason(chunk: OutputChunk) -> str | None:
    """OpenAI's finish_reason: "length" when a token bound (or the time limit) ended it,
    "stop" otherwise; None while unfinished."""
    if not chunk.finished:
        return None
    return "length" if chunk.stop_reason in _LENGTH else "stop"


def usage(inputs: Sequence[PreparedInput], n: int, generated: Sequence[int]) -> dict[str, int]:
    """Prompt tokens counted once per prompt (not per choice), completion tokens per choice."""
    prompt = sum(inp.input_token_count for inp in inputs[::n])
    completion = sum(generated)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def logprob(value: float | None) -> float | None:
    """A logprob for JSON: NaN (the first prompt token's) is None, -inf MIN_LOGPROB."""
    if value is None or math.isnan(value):
        return None
    return value if math.isfinite(value) else MIN_LOGPROB


class TokenTexts:
    """Vocabulary pieces (what the engine's token details carry) as the text they stand for."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer

    def __call__(self, piece: str) -> str:
        return str(self._tokenizer.convert_tokens_to_string([piece]))


def sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """A ``text/event-stream`` of `events` (each group of events written at once), then
    ``data: [DONE]``. An ApiError raised while
    streaming is sent as one ``data: {"error": ...}`` event before the end. `generation` is
    closed however the response ends, a client gone mid-stream included (its jobs are
    cancelled, freeing their KV blocks)."""

    def __init__(self, events: AsyncIterator[list[dict[str, Any]]], generation: Generation) -> None:
        super().__init__(
            self._encode(events),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.generation = generation

    @staticmethod
    async def _encode(events: AsyncIterator[list[dict[str, Any]]]) -> AsyncIterator[bytes]:
        try:
            async for group in events:
                yield b"".join(sse(event) for event in group)
        except ApiError as e:
            yield b"data: " + e.response().body + b"\n\n"
        yield DONE

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.close()
