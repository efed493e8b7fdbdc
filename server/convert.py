"""The one place where protobuf messages meet engine and server dataclasses.

Inbound: validated `DecodingParams` -> engine `SamplingParams`. Outbound: protobuf-free
`OutputChunk`s (what one or more generated tokens added) -> `GenerationResponse`s, and the
Tokenize / ModelInfo responses.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.request import FinishReason
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import TokenLogprobs
from server.pb import generation_pb2 as pb
from server.validation import DecodingParams


def sampling_params(params: DecodingParams) -> SamplingParams:
    """Engine parameters of one validated input (`max_new_tokens` already clamped)."""
    lp = params.length_penalty
    return SamplingParams(
        max_new_tokens=params.max_new_tokens,
        min_new_tokens=params.min_new_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        typical_p=params.typical_p,
        seed=params.seed,
        repetition_penalty=params.repetition_penalty,
        length_penalty=None if lp is None else (lp.start_index, lp.decay_factor),
        logprobs=params.generated_tokens and wants_token_details(params),
        prompt_logprobs=params.input_tokens and wants_token_details(params),
        top_n_tokens=params.top_n_tokens,
    )


def wants_token_details(params: DecodingParams) -> bool:
    """Whether logprobs, ranks or top tokens were requested."""
    return params.token_logprobs or params.token_ranks or params.top_n_tokens > 0


def stop_reason(reason: FinishReason, max_is_token_limit: bool) -> pb.StopReason:
    """TGIS's StopReason for an engine finish reason; MAX_TOKENS becomes TOKEN_LIMIT when the
    server lowered max_new_tokens to fit the sequence limit."""
    if reason == FinishReason.MAX_TOKENS and max_is_token_limit:
        return pb.TOKEN_LIMIT
    return pb.StopReason.Value(reason.value)


@dataclass(frozen=True)
class TokenDetail:
    """One token for `TokenInfo`: its vocabulary piece and, when requested, logprob / rank /
    top alternatives ((piece, logprob) pairs)."""

    text: str
    logprob: float | None = None
    rank: int | None = None
    top_tokens: tuple[tuple[str, float | None], ...] = ()


@dataclass
class OutputChunk:
    """What a request's stream gained: text delta, the running generated-token count, token
    details (when requested), and, on the last chunk, the stop reason."""

    text: str = ""
    generated_token_count: int = 0
    tokens: list[TokenDetail] = field(default_factory=list)
    stop_reason: pb.StopReason = pb.NOT_FINISHED
    stop_sequence: str = ""

    @property
    def finished(self) -> bool:
        return self.stop_reason != pb.NOT_FINISHED


def token_detail(
    lp: TokenLogprobs, params: DecodingParams, pieces: Callable[[Sequence[int]], list[str]]
) -> TokenDetail:
    """A generated token's `TokenDetail` from the engine's logprobs, with what was requested;
    top tokens are sorted by logprob, or by id (without logprobs) when logprobs are off."""
    top: tuple[tuple[str, float | None], ...] = ()
    if params.top_n_tokens:
        pairs = list(zip(lp.top_token_ids, lp.top_logprobs, strict=True))
        if not params.token_logprobs:
            pairs.sort()
        texts = pieces([i for i, _ in pairs])
        top = tuple(
            (t, v if params.token_logprobs else None)
            for t, (_, v) in zip(texts, pairs, strict=True)
        )
    return TokenDetail(
        pieces([lp.token_id])[0],
        lp.logprob if params.token_logprobs else None,
        lp.rank if params.token_ranks else None,
        top,
    )


def input_token_details(
    token_ids: Sequence[int],
    prompt_logprobs: Sequence[TokenLogprobs] | None,
    params: DecodingParams,
    pieces: Callable[[Sequence[int]], list[str]],
) -> list[TokenDetail]:
    """`input_tokens` of a response: the first token has logprob NaN (when logprobs are on)
    and no rank or top tokens; each later one is scored given its prefix, when the engine
    computed `prompt_logprobs` (otherwise text only)."""
    if not token_ids:
        return []
    texts = pieces(token_ids)
    first = TokenDetail(texts[0], math.nan if params.token_logprobs else None)
    if prompt_logprobs is None or len(prompt_logprobs) != len(token_ids) - 1:
        return [first] + [TokenDetail(t) for t in texts[1:]]
    return [first] + [token_detail(lp, params, pieces) for lp in prompt_logprobs]


def token_info(detail: TokenDetail) -> pb.TokenInfo:
    info = pb.TokenInfo(text=detail.text)
    if detail.logprob is not None:
        info.logprob = detail.logprob
    if detail.rank is not None:
        info.rank = detail.rank
    for text, logprob in detail.top_tokens:
        top = info.top_tokens.add(text=text)
        if logprob is not None:
            top.logprob = logprob
    return info


def stream_message(chunk: OutputChunk, seed: int) -> pb.GenerationResponse:
    """One GenerateStream message after the first; `seed` goes on the final one only."""
    msg = pb.GenerationResponse(
        generated_token_count=chunk.generated_token_count,
        text=chunk.text,
        stop_reason=chunk.stop_reason,
        stop_sequence=chunk.stop_sequence,
    )
    msg.tokens.extend(token_info(t) for t in chunk.tokens)
    if chunk.finished:
        msg.seed = seed
    return msg


def first_stream_message(
    input_token_count: int, input_text: str, seed: int
) -> pb.GenerationResponse:
    """GenerateStream's first message: input_token_count, the input text if requested, seed."""
    return pb.GenerationResponse(input_token_count=input_token_count, text=input_text, seed=seed)


def input_tokens_message(
    input_token_count: int, tokens: Sequence[TokenDetail]
) -> pb.GenerationResponse:
    """GenerateStream's optional second message: the input tokens' details."""
    msg = pb.GenerationResponse(input_token_count=input_token_count)
    msg.input_tokens.extend(token_info(t) for t in tokens)
    return msg


def unary_response(
    chunks: Sequence[OutputChunk],
    input_token_count: int,
    input_text: str,
    seed: int,
    input_tokens: Sequence[TokenDetail] = (),
) -> pb.GenerationResponse:
    """A Generate response: the concatenated chunks (text prefixed by `input_text`), the last
    chunk's count and stop reason."""
    last = chunks[-1] if chunks else OutputChunk()
    msg = pb.GenerationResponse(
        input_token_count=input_token_count,
        generated_token_count=last.generated_token_count,
        text=input_text + "".join(c.text for c in chunks),
        stop_reason=last.stop_reason,
        stop_sequence=last.stop_sequence,
        seed=seed,
    )
    msg.tokens.extend(token_info(t) for c in chunks for t in c.tokens)
    msg.input_tokens.extend(token_info(t) for t in input_tokens)
    return msg


def tokenize_response(
    token_count: int,
    tokens: Sequence[str] | None,
    offsets: Sequence[tuple[int, int]] | None,
) -> pb.TokenizeResponse:
    """One Tokenize result; `tokens` / `offsets` are None unless requested."""
    msg = pb.TokenizeResponse(token_count=token_count)
    if tokens is not None:
        msg.tokens.extend(tokens)
    if offsets is not None:
        msg.offsets.extend(pb.TokenizeResponse.Offset(start=s, end=e) for s, e in offsets)
    return msg


def model_info_response(max_sequence_length: int, max_new_tokens: int) -> pb.ModelInfoResponse:
    return pb.ModelInfoResponse(
        model_kind=pb.ModelInfoResponse.DECODER_ONLY,
        max_sequence_length=max_sequence_length,
        max_new_tokens=max_new_tokens,
    )
