"""From an OpenAI request's fields to the server's `DecodingParams` (checked by the gRPC API's
`validate_parameters`, so both APIs refuse the same values) and the engine's `SamplingParams`.

OpenAI's defaults and bounds come first: temperature 1.0 when absent (0: greedy) and at most 2;
`n` from 1 to min(128, MAX_CONCURRENT_REQUESTS); at most 4 `stop` strings, never included in
the text; penalties within [-2, 2]; logit_bias values within [-100, 100] on token ids of the
vocabulary. Choice i of a seeded request samples with `choice_seed(seed, i)`: choice 0 with the
seed itself, so a seeded request with n = 1 draws as the same request over gRPC does.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from typing import Any

from engine.sampling.params import SamplingParams
from server import convert
from server.messages import ValidationError
from server.openai.errors import ApiError, bad_request, from_validation
from server.openai.protocol import MAX_N, MAX_STOP, ChatCompletionRequest, CompletionRequest
from server.validation import DecodingParams, Limits, validate_parameters

DEFAULT_COMPLETION_MAX_TOKENS = 16
"""OpenAI's max_tokens default for /v1/completions; chat defaults to the server's cap
(MAX_NEW_TOKENS), lowered to what the sequence limit leaves."""
MAX_LOGIT_BIAS = 100.0
MAX_PENALTY = 2.0
_U64 = 2**64


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request seeded with `seed` (an unsigned 64-bit value):
    `seed` for choice 0, a hash of both for the others."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclass(frozen=True)
class Sampling:
    """A request's validated decoding parameters (`params`, seed unset per choice) and the
    engine fields beyond them (`extras`: penalties and logit bias, set only when not
    neutral)."""

    params: DecodingParams
    n: int
    extras: dict[str, Any]

    def for_choice(self, index: int) -> DecodingParams:
        """The parameters of choice `index` (prompt-major: prompt p, choice c is p * n + c)."""
        if self.params.greedy or self.params.seed is None:
            return self.params
        return replace(self.params, seed=choice_seed(self.params.seed, index))

    def engine_params(self, params: DecodingParams) -> SamplingParams:
        """The engine's parameters of one prepared input (ValidationError for values the
        engine's own checks refuse)."""
        try:
            return replace(convert.sampling_params(params), **self.extras)
        except ValueError as e:
            raise ValidationError(str(e)) from e


def _in_range(name: str, value: float, low: float, high: float) -> float:
    if not (math.isfinite(value) and low <= value <= high):
        raise bad_request(f"{name} must be between {low:g} and {high:g}, got {value!r}", name)
    return value


def _extras(req: CompletionRequest | ChatCompletionRequest, vocab_size: int) -> dict[str, Any]:
    extras: dict[str, Any] = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None and _in_range(name, value, -MAX_PENALTY, MAX_PENALTY) != 0.0:
            extras[name] = value
    if req.logit_bias:
        bias: dict[int, float] = {}
        for key, value in req.logit_bias.items():
            if not key.isdigit() or int(key) >= vocab_size:
                raise bad_request(
                    f"logit_bias keys must be token ids below {vocab_size}, got {key[:32]!r}",
                    "logit_bias",
                )
            bias[int(key)] = _in_range("logit_bias", value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        extras["logit_bias"] = bias
    return extras


def sampling(
    req: CompletionRequest | ChatCompletionRequest,
    limits: Limits,
    max_concurrent_requests: int,
    vocab_size: int,
) -> Sampling:
    """Check `req`'s generation fields and map them; ApiError (400) naming the field."""
    chat = isinstance(req, ChatCompletionRequest)
    prompt_param, top_param = ("messages", "top_logprobs") if chat else ("prompt", "logprobs")
    max_n = min(MAX_N, max_concurrent_requests)
    if not 1 <= req.n <= max_n:
        raise bad_request(f"n must be between 1 and {max_n}, got {req.n}", "n")
    max_tokens = req.max_tokens
    param = "max_tokens"
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens = limits.max_new_tokens if chat else DEFAULT_COMPLETION_MAX_TOKENS
    if max_tokens < 1:
        raise bad_request(f"{param} must be at least 1, got {max_tokens}", param)
    if req.min_tokens < 0:
        raise bad_request(f"min_tokens must be >= 0, got {req.min_tokens}", "min_tokens")
    temperature = 1.0 if req.temperature is None else req.temperature
    _in_range("temperature", temperature, 0.0, 2.0)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP:
        raise bad_request(f"stop takes at most {MAX_STOP} sequences, got {len(stop)}", "stop")
    seed = None
    if req.seed is not None:
        if not -(2**63) <= req.seed < _U64:
            raise bad_request("seed must be a 64-bit integer", "seed")
        seed = req.seed % _U64
    top_n, logprobs = 0, False
    if isinstance(req, ChatCompletionRequest):
        logprobs = req.logprobs
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
            top_n = req.top_logprobs
    elif req.logprobs is not None:
        logprobs, top_n = True, req.logprobs
    if top_n < 0:
        raise bad_request(f"{top_param} must be >= 0, got {top_n}", top_param)
    top_k = req.top_k if req.top_k not in (None, -1) else 0
    params = DecodingParams(
        greedy=temperature == 0.0,
        temperature=temperature,
        top_k=top_k,
        top_p=1.0 if req.top_p is None else req.top_p,
        typical_p=1.0 if req.typical_p is None else req.typical_p,
        seed=seed,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        min_new_tokens=req.min_tokens,
        max_new_tokens=max_tokens,
        stop_sequences=tuple(stop),
        include_stop_sequence=False,
        generated_tokens=logprobs,
        input_tokens=logprobs and isinstance(req, CompletionRequest) and req.echo,
        token_logprobs=logprobs,
        top_n_tokens=top_n,
    )
    try:
        validate_parameters(params, limits)
    except ValidationError as e:
        error: ApiError = from_validation(e, prompt_param, top_param)
        if error.param == "max_tokens" and param != "max_tokens":
            error = bad_request(error.message.replace("max_tokens", param, 1), param)
        raise error from None
    if params.greedy:
        params = replace(params, top_k=0, top_p=1.0, typical_p=1.0, seed=None)
    return Sampling(params, req.n, _extras(req, vocab_size))
