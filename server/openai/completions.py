"""`POST /v1/completions`: prompts (a string, strings, token ids or lists of token ids), `n`
choices each, `echo`, `logprobs` (the top `logprobs` tokens per position), unary or streamed."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.responses import JSONResponse, Response

from server.convert import OutputChunk, TokenDetail
from server.openai.context import ApiContext
from server.openai.errors import bad_request
from server.openai.generation import Generation, Prompt
from server.openai.protocol import CompletionRequest
from server.openai.sampling import Sampling, sampling
from server.openai.streaming import (
    EventStream,
    TokenTexts,
    created,
    finish_reason,
    logprob,
    new_id,
    usage,
)
from server.tracing import Metadata

ROUTE = "/v1/completions"


def _check(ctx: ApiContext, req: CompletionRequest) -> Sampling:
    for name in ("suffix", "best_of"):
        if getattr(req, name) not in (None, 1 if name == "best_of" else None):
            raise bad_request(f"{name} is not supported by this server", name)
    return sampling(req, ctx.limits, ctx.max_concurrent_requests, ctx.vocab_size)


def prompts_of(req: CompletionRequest) -> list[Prompt]:
    p = req.prompt
    if isinstance(p, str):
        return [Prompt(p)]
    if not p:
        raise bad_request("prompt must not be empty", "prompt")
    if isinstance(p[0], int):
        return [Prompt(None, [int(i) for i in p])]
    if isinstance(p[0], str):
        return [Prompt(str(t)) for t in p]
    return [Prompt(None, list(ids)) for ids in p]


class _Logprobs:
    """OpenAI's completion logprobs (tokens, token_logprobs, top_logprobs, text_offset) of
    one choice, offsets running on from earlier chunks."""

    def __init__(self, texts: TokenTexts) -> None:
        self.texts = texts
        self.offset = 0

    def of(self, details: Sequence[TokenDetail]) -> dict[str, Any]:
        tokens = [self.texts(d.text) for d in details]
        offsets = []
        for token in tokens:
            offsets.append(self.offset)
            self.offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [logprob(d.logprob) for d in details],
            "top_logprobs": [
                {self.texts(piece): logprob(lp) for piece, lp in d.top_tokens} or None
                for d in details
            ],
            "text_offset": offsets,
        }


async def create(ctx: ApiContext, req: CompletionRequest, headers: Metadata) -> Response:
    kind = "openai_completions_stream" if req.stream else "openai_completions"
    gen = Generation(ctx.runner, kind, ROUTE, headers, "prompt", "logprobs", ctx.vocab_size)
    params = gen.check(lambda: _check(ctx, req))
    prompts = gen.check(lambda: prompts_of(req))
    await gen.open(len(prompts), lambda: prompts, params)
    head = {"id": new_id("cmpl"), "object": "text_completion", "created": created()}
    head["model"] = ctx.model_id
    texts = TokenTexts(ctx.runner.tokenizer)
    if req.stream:
        include = req.stream_options is not None and req.stream_options.include_usage
        return EventStream(_events(gen, req, head, texts, include), gen)
    try:
        results = await gen.collect()
    finally:
        gen.close()
    choices = []
    for i, chunks in enumerate(results):
        echo = _echo(gen, i, req, texts) if req.echo else None
        choices.append(_choice(i, chunks, chunks[-1], texts, req, echo))
    counts = [chunks[-1].generated_token_count for chunks in results]
    body = {**head, "choices": choices, "usage": usage(gen.inputs, params.n, counts)}
    return JSONResponse(body)


def _echo(
    gen: Generation, index: int, req: CompletionRequest, texts: TokenTexts
) -> tuple[str, list[TokenDetail]]:
    """The prompt text of choice `index` and, with logprobs, its tokens' details."""
    inp = gen.inputs[index]
    details: list[TokenDetail] = []
    if req.logprobs is not None:
        details = gen.jobs[index].tracker.input_tokens(inp.input_token_ids)
    return inp.text, details


def _choice(
    index: int,
    chunks: Sequence[OutputChunk],
    last: OutputChunk,
    texts: TokenTexts,
    req: CompletionRequest,
    echo: tuple[str, list[TokenDetail]] | None,
    logprobs: _Logprobs | None = None,
) -> dict[str, Any]:
    text = "".join(c.text for c in chunks)
    details = [d for c in chunks for d in c.tokens]
    if echo is not None:
        text = echo[0] + text
        details = echo[1] + details
    lp = None
    if req.logprobs is not None:
        lp = (logprobs or _Logprobs(texts)).of(details)
    return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason(last)}


async def _events(
    gen: Generation,
    req: CompletionRequest,
    head: dict[str, Any],
    texts: TokenTexts,
    include_usage: bool,
) -> AsyncIterator[list[dict[str, Any]]]:
    extra: dict[str, Any] = {"usage": None} if include_usage else {}
    pending = [req.echo] * len(gen.jobs)
    logprobs = [_Logprobs(texts) for _ in gen.jobs]
    counts = [0] * len(gen.jobs)
    async for batch in gen.batches():
        events = []
        for i, chunk in batch:
            counts[i] = chunk.generated_token_count
            echo = None
            if pending[i]:
                pending[i] = False
                echo = _echo(gen, i, req, texts)
            if not (chunk.text or chunk.tokens or chunk.finished or echo):
                continue
            choice = _choice(i, [chunk], chunk, texts, req, echo, logprobs[i])
            events.append({**head, "choices": [choice], **extra})
        if events:
            yield events
    if include_usage:
        yield [{**head, "choices": [], "usage": usage(gen.inputs, req.n, counts)}]
