"""Request bodies of the OpenAI-compatible API as pydantic models, parsed strictly from JSON
(a string where a number belongs is refused, not coerced). Fields OpenAI defines that this
server does not know are ignored, as OpenAI-compatible servers (vLLM) do; the ones parsed
here that this server does not implement (`suffix`, `best_of`, `tools`, a non-text
`response_format`) would change the output, so the endpoints refuse a request setting them.
TGIS's own knobs (top_k, typical_p, repetition_penalty, min_tokens) are accepted as the extra
fields vLLM accepts for them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 128
"""OpenAI's bound on `n`; MAX_CONCURRENT_REQUESTS may lower it (`server.openai.sampling`)."""
MAX_STOP = 4
"""OpenAI's bound on the number of `stop` strings."""


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Generation(_Body):
    """What completions and chat completions share."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # TGIS's knobs, as vLLM's extra sampling fields
    top_k: int | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0


class CompletionRequest(_Generation):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
