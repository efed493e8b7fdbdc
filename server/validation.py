"""TGIS request parameter conversion and validation (docs/tgis-compatibility.md: "Parameter
conversion", "Validation").

Pure functions: no gRPC server, no engine, no tokenizer. The servicer uses them in TGIS's order:

1. `request_parameters` (or `convert_parameters` + `validate_parameters`): TGIS's defaults, then
   its parameter checks, before any tokenization;
2. prefix lookup and tokenization (the caller's; format their failures with
   `prefix_lookup_error` / `tokenizer_error`);
3. `validate_input` once per input: truncation, the length checks, TOKEN_LIMIT clamping and the
   per-input random seed.

Every failure raises `ValidationError` whose message is TGIS's verbatim; the servicer returns it as
INVALID_ARGUMENT. The result, `DecodingParams`, holds no protobuf types.

Beyond TGIS, so that no request can harm another (docs/deployment.md, "Request limits"):

- non-finite floats (NaN, +-inf) are rejected with the message TGIS uses for the field (every
  TGIS comparison is false for NaN and lets it through), +inf temperature and -inf typical_p
  included;
- `top_n_tokens` is at most MAX_TOP_N_TOKENS (vllm-tgis-adapter's bound and message);
- an input text is at most `Limits.max_input_bytes` UTF-8 bytes (`check_input_size`);
- user text quoted in a message (prefix ids, tokenizer errors) is cut by `clip`;
- a field this server's proto does not define (a newer client's, such as vllm-tgis-adapter's
  adapter_id or guided decoding) fails the request, naming it (`server.proto_fields`);
- a `method` number DecodingMethod does not define fails the request, instead of running as
  GREEDY (`messages.decoding_method_error`).

The messages themselves and `ValidationError` are in `server.messages`.
"""

from __future__ import annotations

import math
import random
import struct
from dataclasses import dataclass, replace
from typing import NamedTuple

from engine.sampling.params import draw_seed
from server import messages as msg
from server.pb import generation_pb2 as pb
from server.proto_fields import check_known_fields

DEFAULT_MAX_NEW_TOKENS = 20
"""max_new_tokens when the request leaves it 0 (TGIS's router constant)."""
MAX_I32 = 2**31 - 1
MIN_INPUT_BYTES = 256 * 1024
INPUT_BYTES_PER_TOKEN = 64
"""An input text may hold `max(MIN_INPUT_BYTES, INPUT_BYTES_PER_TOKEN * max_sequence_length)`
UTF-8 bytes: far more than any text of max_sequence_length tokens, so truncation still works,
while bounding what one input costs to tokenize."""


def _f32(x: float) -> float:
    """`x` rounded to float32: TGIS compares its f32 parameters against f32 constants."""
    return float(struct.unpack("<f", struct.pack("<f", x))[0])


_MIN_TEMPERATURE = _f32(0.05)


@dataclass(frozen=True)
class Limits:
    """The server limits validation enforces (TGIS launcher MAX_SEQUENCE_LENGTH, MAX_NEW_TOKENS).

    `max_sequence_length` bounds input (after truncation) + prompt prefix + generated tokens;
    `max_new_tokens` bounds the requested max_new_tokens (the default 20 is not clamped to it).
    """

    max_sequence_length: int
    max_new_tokens: int

    def __post_init__(self) -> None:
        if self.max_sequence_length < 1 or self.max_new_tokens < 1:
            raise ValueError(f"invalid limits: {self}")

    @property
    def max_input_bytes(self) -> int:
        """The most UTF-8 bytes of one input text (Generate and Tokenize)."""
        return max(MIN_INPUT_BYTES, INPUT_BYTES_PER_TOKEN * self.max_sequence_length)


def check_input_size(text: str, limits: Limits) -> None:
    """Raise `messages.input_size_error` when `text` is longer than `limits.max_input_bytes`."""
    cap = limits.max_input_bytes
    if len(text) > cap // 4:  # else it cannot exceed the cap (at most 4 bytes a character)
        n = len(text.encode("utf-8", "surrogatepass"))
        if n > cap:
            raise msg.input_size_error(n, cap)


class LengthPenalty(NamedTuple):
    """After `start_index` generated tokens, EOS's score grows by `decay_factor` per token."""

    start_index: int
    decay_factor: float


@dataclass(frozen=True)
class DecodingParams:
    """Decoding settings of one request, protobuf-free; the engine maps them to its own params.

    Conventions (TGIS's): `greedy` is True exactly when `temperature` is 0.0; disabled warpers
    hold their neutral value (top_k 0, top_p 1.0, typical_p 1.0); `seed` None means "pick one"
    (`validate_input` does, per input, for sampling); `max_new_tokens` is already defaulted (20)
    and, after `validate_input`, clamped to the sequence limit with `max_is_token_limit` set (the
    stop reason is then TOKEN_LIMIT); `include_stop_sequence` None means the server default
    (DEFAULT_INCLUDE_STOP_SEQS); `time_limit_millis` 0 means none, counted from request
    arrival; `truncate_input_tokens` N > 0 keeps the last N input tokens.
    """

    greedy: bool = True
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    length_penalty: LengthPenalty | None = None
    min_new_tokens: int = 0
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    max_is_token_limit: bool = False
    stop_sequences: tuple[str, ...] = ()
    include_stop_sequence: bool | None = None
    time_limit_millis: int = 0
    truncate_input_tokens: int = 0
    # Response options
    input_text: bool = False
    generated_tokens: bool = False
    input_tokens: bool = False
    token_logprobs: bool = False
    token_ranks: bool = False
    top_n_tokens: int = 0

    def __post_init__(self) -> None:
        if self.greedy != (self.temperature == 0.0):
            raise ValueError(
                f"greedy={self.greedy} contradicts temperature={self.temperature} "
                "(greedy iff temperature == 0.0)"
            )


@dataclass(frozen=True)
class ValidatedInput:
    """One input that passed validation.

    `input_length` is its token count after truncation (special tokens included, prefix
    excluded): the response's input_token_count. `params` are the request's parameters
    specialised for this input (clamped max_new_tokens, seed, normalised truncation).
    """

    input_length: int
    prefix_length: int
    params: DecodingParams


def convert_parameters(params: pb.Parameters | None) -> DecodingParams:
    """TGIS's parameter conversion: map request `params` (None if absent) to DecodingParams,
    without checking them.

    GREEDY ignores `sampling` entirely. SAMPLE copies it, with 0 meaning disabled for top_p and
    typical_p (and a finite negative typical_p, which passes validation, also disabled), then
    turns temperature 0 into 1.0. repetition_penalty 0 means 1.0; max_new_tokens 0 means 20.
    Non-finite values are kept for `validate_parameters` to reject.
    """
    if params is None:
        return DecodingParams()
    out = DecodingParams(truncate_input_tokens=params.truncate_input_tokens)
    if params.HasField("response"):
        r = params.response
        out = replace(
            out,
            input_text=r.input_text,
            generated_tokens=r.generated_tokens,
            input_tokens=r.input_tokens,
            token_logprobs=r.token_logprobs,
            token_ranks=r.token_ranks,
            top_n_tokens=r.top_n_tokens,
        )
    if params.HasField("decoding"):
        d = params.decoding
        if d.repetition_penalty != 0.0:
            out = replace(out, repetition_penalty=d.repetition_penalty)
        if d.HasField("length_penalty"):
            lp = LengthPenalty(d.length_penalty.start_index, d.length_penalty.decay_factor)
            out = replace(out, length_penalty=lp)
    if params.HasField("stopping"):
        s = params.stopping
        out = replace(
            out,
            max_new_tokens=s.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
            min_new_tokens=s.min_new_tokens,
            stop_sequences=tuple(s.stop_sequences),
            include_stop_sequence=(
                s.include_stop_sequence if s.HasField("include_stop_sequence") else None
            ),
            time_limit_millis=s.time_limit_millis,
        )
    if params.method == pb.SAMPLE:
        sp = params.sampling  # all-default when absent
        out = replace(
            out,
            greedy=False,
            temperature=sp.temperature if sp.temperature != 0.0 else 1.0,
            top_k=sp.top_k,
            top_p=sp.top_p if sp.top_p != 0.0 else 1.0,
            typical_p=(
                sp.typical_p if sp.typical_p > 0.0 or not math.isfinite(sp.typical_p) else 1.0
            ),
            seed=sp.seed if sp.HasField("seed") else None,
        )
    return out


def validate_parameters(params: DecodingParams, limits: Limits) -> None:
    """TGIS's parameter checks, in its order; raises ValidationError on the first failure.

    Float comparisons are done as TGIS does them, in float32 (so 0.05 passes the temperature
    check). A top_k above the int32 range is what TGIS reports as not strictly positive. Every
    non-finite float fails with its field's message: NaN or inf temperature "must be >= 0.05",
    NaN top_p "> 0.0 and <= 1.0", NaN or +-inf typical_p "<= 1.0", NaN or inf
    repetition_penalty "> 0.0", a NaN decay_factor the length_penalty range.
    `top_n_tokens` above MAX_TOP_N_TOKENS fails just before the token-detail check.
    """
    p = params
    if not math.isfinite(p.temperature) or (
        p.temperature != 0.0 and p.temperature < _MIN_TEMPERATURE
    ):
        raise msg.ValidationError(msg.TEMPERATURE_MSG)
    if not 0.0 < p.top_p <= 1.0:  # also false for NaN
        raise msg.ValidationError(msg.TOP_P_MSG)
    if not math.isfinite(p.typical_p) or p.typical_p > 1.0:
        raise msg.ValidationError(msg.TYPICAL_P_MSG)
    if p.top_k < 0 or p.top_k > MAX_I32:
        raise msg.ValidationError(msg.TOP_K_MSG)
    if p.max_new_tokens > limits.max_new_tokens:
        raise msg.max_new_tokens_error(limits.max_new_tokens)
    if p.min_new_tokens > p.max_new_tokens:
        raise msg.ValidationError(msg.MIN_NEW_TOKENS_MSG)
    if not math.isfinite(p.repetition_penalty) or p.repetition_penalty <= 0.0:
        raise msg.ValidationError(msg.REPETITION_PENALTY_MSG)
    if p.length_penalty is not None and not 1.0 <= p.length_penalty.decay_factor <= 10.0:
        raise msg.ValidationError(msg.LENGTH_PENALTY_MSG)  # also for NaN: the comparisons are false
    if len(p.stop_sequences) > msg.MAX_STOP_SEQS:
        raise msg.ValidationError(msg.STOP_SEQUENCES_MSG)
    if p.top_n_tokens > msg.MAX_TOP_N_TOKENS:
        raise msg.top_n_tokens_error(p.top_n_tokens)
    if (p.token_logprobs or p.token_ranks or p.top_n_tokens != 0) and not (
        p.input_tokens or p.generated_tokens
    ):
        raise msg.ValidationError(msg.TOKEN_DETAIL_MSG)
    if any(not s or len(s.encode("utf-8")) > msg.MAX_STOP_SEQ_BYTES for s in p.stop_sequences):
        raise msg.ValidationError(msg.STOP_SEQUENCES_MSG)


def request_parameters(
    request: pb.BatchedGenerationRequest | pb.SingleGenerationRequest, limits: Limits
) -> DecodingParams:
    """Convert and check a generation request's `params` (steps 1 of the module docstring).

    Fields unknown to this server's proto fail first (`check_known_fields`), then an unknown
    `method` number; then, for a SingleGenerationRequest without `request`, ``missing request``.
    """
    check_known_fields(request)
    if request.HasField("params") and request.params.method not in pb.DecodingMethod.values():
        raise msg.decoding_method_error(request.params.method)
    if isinstance(request, pb.SingleGenerationRequest) and not request.HasField("request"):
        raise msg.ValidationError(msg.MISSING_REQUEST_MSG)
    params = convert_parameters(request.params if request.HasField("params") else None)
    validate_parameters(params, limits)
    return params


_system_random = random.SystemRandom()


def validate_input(
    params: DecodingParams,
    num_tokens: int,
    limits: Limits,
    prefix_length: int = 0,
    rng: random.Random | None = None,
) -> ValidatedInput:
    """Length checks of one input, and its final parameters.

    `params` must have passed `validate_parameters`. `num_tokens` is the input's full token count
    (special tokens included) before `truncate_input_tokens` is applied; `prefix_length` is the
    prompt prefix's virtual-token count. Raises ``input tokens (I) plus prefix length (P) must be
    < S`` or ``... plus min_new_tokens (M) must be <= S``. Otherwise max_new_tokens is lowered to
    what the sequence limit leaves (flagging `max_is_token_limit`), truncation is recorded only
    where it shortens the input, and a sampling request without a seed gets a random 32-bit one
    from `rng` (default: the OS's entropy), a fresh one per call.
    """
    truncate = params.truncate_input_tokens
    if 0 < truncate < num_tokens:
        input_length = truncate
    else:
        input_length, truncate = num_tokens, 0
    effective = input_length + prefix_length
    max_len = limits.max_sequence_length
    if effective >= max_len:
        raise msg.input_length_error(input_length, prefix_length, max_len)
    if effective + params.min_new_tokens > max_len:
        raise msg.input_min_length_error(
            input_length, prefix_length, params.min_new_tokens, max_len
        )
    out = replace(params, truncate_input_tokens=truncate)
    if not out.greedy and out.seed is None:
        out = replace(out, seed=draw_seed(rng or _system_random, 32))
    if effective + out.max_new_tokens > max_len:
        out = replace(out, max_new_tokens=max_len - effective, max_is_token_limit=True)
    return ValidatedInput(input_length, prefix_length, out)
