"""`POST /v1/chat/completions`: the messages rendered by the tokenizer's chat template (with the
generation prompt; a model without a template is refused with 400, never guessed), then
generated as a completion of that text; `logprobs` with `top_logprobs`, unary or streamed."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.responses import JSONResponse, Response
from transformers import PreTrainedTokenizerBase

from server.convert import OutputChunk, TokenDetail
from server.messages import ValidationError, clip
from server.openai.context import ApiContext
from server.openai.errors import bad_request
from server.openai.generation import Generation, Prompt
from server.openai.protocol import ChatCompletionRequest, ChatMessage
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

ROUTE = "/v1/chat/completions"
NO_TEMPLATE_MSG = (
    "this model's tokenizer has no chat template, so /v1/chat/completions cannot format "
    "messages for it: use /v1/completions with a prompt"
)


def render(tokenizer: PreTrainedTokenizerBase, messages: Sequence[ChatMessage]) -> Prompt:
    """The prompt of `messages` (on the tokenization pool): the chat template's text with the
    assistant's generation prompt, tokenized without adding special tokens again (the
    template writes its own)."""
    conversation = []
    for m in messages:
        message = {"role": m.role, "content": m.text()}
        if m.name is not None:
            message["name"] = m.name
        conversation.append(message)
    try:
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True
        )
    except Exception as e:
        reason = f"input tokens could not be made by the chat template: {clip(str(e))}"
        raise ValidationError(reason) from e
    return Prompt(str(text), add_special_tokens=False)


def _check(ctx: ApiContext, req: ChatCompletionRequest) -> Sampling:
    if getattr(ctx.runner.tokenizer, "chat_template", None) is None:
        raise bad_request(NO_TEMPLATE_MSG, "messages")
    if req.tools:
        raise bad_request("tools (function calling) are not supported by this server", "tools")
    fmt = (req.response_format or {}).get("type", "text")
    if fmt != "text":
        raise bad_request(
            f"response_format {clip(str(fmt), 64)!r} is not supported; only text",
            "response_format",
        )
    return sampling(req, ctx.limits, ctx.max_concurrent_requests, ctx.vocab_size)


def _logprobs(details: Sequence[TokenDetail], texts: TokenTexts) -> list[dict[str, Any]]:
    def entry(piece: str, value: float | None) -> dict[str, Any]:
        token = texts(piece)
        return {"token": token, "logprob": logprob(value), "bytes": list(token.encode())}

    out = []
    for d in details:
        item = entry(d.text, d.logprob)
        item["top_logprobs"] = [entry(piece, lp) for piece, lp in d.top_tokens]
        out.append(item)
    return out


async def create(ctx: ApiContext, req: ChatCompletionRequest, headers: Metadata) -> Response:
    kind = "openai_chat_stream" if req.stream else "openai_chat"
    gen = Generation(ctx.runner, kind, ROUTE, headers, "messages", "top_logprobs", ctx.vocab_size)
    params = gen.check(lambda: _check(ctx, req))
    tokenizer = ctx.runner.tokenizer
    await gen.open(1, lambda: [render(tokenizer, req.messages)], params)
    head = {"id": new_id("chatcmpl"), "created": created(), "model": ctx.model_id}
    texts = TokenTexts(tokenizer)
    if req.stream:
        include = req.stream_options is not None and req.stream_options.include_usage
        return EventStream(_events(gen, req, head, texts, include), gen)
    try:
        results = await gen.collect()
    finally:
        gen.close()
    choices = []
    for i, chunks in enumerate(results):
        details = [d for c in chunks for d in c.tokens]
        choices.append(
            {
                "index": i,
                "message": {"role": "assistant", "content": "".join(c.text for c in chunks)},
                "logprobs": {"content": _logprobs(details, texts)} if req.logprobs else None,
                "finish_reason": finish_reason(chunks[-1]),
            }
        )
    counts = [chunks[-1].generated_token_count for chunks in results]
    body = {**head, "object": "chat.completion", "choices": choices}
    body["usage"] = usage(gen.inputs, params.n, counts)
    return JSONResponse(body)


def _delta(
    index: int, delta: dict[str, Any], chunk: OutputChunk | None, logprobs: Any
) -> dict[str, Any]:
    return {
        "index": index,
        "delta": delta,
        "logprobs": logprobs,
        "finish_reason": None if chunk is None else finish_reason(chunk),
    }


async def _events(
    gen: Generation,
    req: ChatCompletionRequest,
    head: dict[str, Any],
    texts: TokenTexts,
    include_usage: bool,
) -> AsyncIterator[list[dict[str, Any]]]:
    head = {**head, "object": "chat.completion.chunk"}
    extra: dict[str, Any] = {"usage": None} if include_usage else {}
    role = {"role": "assistant", "content": ""}
    yield [
        {**head, "choices": [_delta(i, role, None, None)], **extra} for i in range(len(gen.jobs))
    ]
    counts = [0] * len(gen.jobs)
    async for batch in gen.batches():
        events = []
        for i, chunk in batch:
            counts[i] = chunk.generated_token_count
            if not (chunk.text or chunk.tokens or chunk.finished):
                continue
            delta = {"content": chunk.text} if chunk.text else {}
            lp = {"content": _logprobs(chunk.tokens, texts)} if req.logprobs else None
            events.append({**head, "choices": [_delta(i, delta, chunk, lp)], **extra})
        if events:
            yield events
    if include_usage:
        yield [{**head, "choices": [], "usage": usage(gen.inputs, req.n, counts)}]
