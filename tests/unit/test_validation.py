"""server.validation against docs/tgis-compatibility.md, "Parameter conversion" and "Validation"
(exact messages).

Messages are asserted as literal strings copied from the reference, never via the module's
constants. Requests are built the way TGIS's YAML tests build them: `json_format.ParseDict` on
camelCase dicts into the generated classes.
"""

from __future__ import annotations

import dataclasses
import random
import struct
from typing import Any

import pytest
from google.protobuf import json_format
from transformers import AutoTokenizer

from engine.paths import model_path
from server.input_preparer import InputPreparer
from server.messages import (
    ValidationError,
    clip,
    prefix_lookup_error,
    prefix_not_found_reason,
    tokenizer_error,
)
from server.metrics import ServerMetrics
from server.pb import generation_pb2 as pb
from server.validation import (
    DecodingParams,
    LengthPenalty,
    Limits,
    ValidatedInput,
    check_input_size,
    convert_parameters,
    request_parameters,
    validate_input,
    validate_parameters,
)

# The limits of TGIS's integration tests (--max-sequence-length 200 --max-new-tokens 169).
LIMITS = Limits(max_sequence_length=200, max_new_tokens=169)
STOP_MSG = "can specify at most 6 non-empty stop sequences, each not more than 240 UTF8 bytes"
DETAIL_MSG = "must request input and/or generated tokens to request extra token detail"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(str(model_path("tiny-llama-gqa-tied")))


def batch(params: dict[str, Any] | None = None, n: int = 1) -> pb.BatchedGenerationRequest:
    """A BatchedGenerationRequest with `n` inputs, through a serialization round trip."""
    body: dict[str, Any] = {
        "modelId": "ignored",
        "requests": [{"text": f"in{i}"} for i in range(n)],
    }
    if params is not None:
        body["params"] = params
    msg = json_format.ParseDict(body, pb.BatchedGenerationRequest())
    return pb.BatchedGenerationRequest.FromString(msg.SerializeToString())


def params_of(params: dict[str, Any] | None) -> DecodingParams:
    return request_parameters(batch(params), LIMITS)


def validated(
    params: dict[str, Any] | None,
    tokens: int,
    prefix_length: int = 0,
    rng: random.Random | None = None,
) -> ValidatedInput:
    """One input of `tokens` tokens as the servicer validates it: `request_parameters` on the
    call, then `validate_input` on the input."""
    return validate_input(params_of(params), tokens, LIMITS, prefix_length, rng)


def error_of(params: dict[str, Any] | None, tokens: int = 10) -> str:
    with pytest.raises(ValidationError) as info:
        validated(params, tokens)
    assert str(info.value) == info.value.message
    return info.value.message


def f32(x: float) -> float:
    return float(struct.unpack("<f", struct.pack("<f", x))[0])


def f32_below(x: float) -> float:
    """The largest float32 below float32(x) (x > 0)."""
    (bits,) = struct.unpack("<I", struct.pack("<f", x))
    return float(struct.unpack("<f", struct.pack("<I", bits - 1))[0])


# TGIS's messages, one test per message, in TGIS's check order.


def test_temperature() -> None:
    assert error_of({"method": "SAMPLE", "sampling": {"temperature": 0.02}}) == (
        "temperature must be >= 0.05"
    )
    assert error_of({"method": "SAMPLE", "sampling": {"temperature": -1.0}}) == (
        "temperature must be >= 0.05"
    )
    assert error_of({"method": "SAMPLE", "sampling": {"temperature": f32_below(0.05)}}) == (
        "temperature must be >= 0.05"
    )
    assert params_of({"method": "SAMPLE", "sampling": {"temperature": 0.05}}).temperature == f32(
        0.05
    )
    # GREEDY ignores `sampling` entirely.
    assert params_of({"sampling": {"temperature": 0.02}}).greedy


def test_top_p() -> None:
    for top_p in (1.5, -0.1):
        assert error_of({"method": "SAMPLE", "sampling": {"topP": top_p}}) == (
            "top_p must be > 0.0 and <= 1.0"
        )
    assert params_of({"method": "SAMPLE", "sampling": {"topP": 1.0}}).top_p == 1.0


def test_typical_p() -> None:
    assert error_of({"method": "SAMPLE", "sampling": {"typicalP": 1.01}}) == (
        "typical_p must be <= 1.0"
    )
    # Negative passes and means disabled.
    assert params_of({"method": "SAMPLE", "sampling": {"typicalP": -0.5}}).typical_p == 1.0
    assert params_of({"method": "SAMPLE", "sampling": {"typicalP": 0.5}}).typical_p == 0.5


def test_top_k() -> None:
    # Only reachable when the uint32 overflows TGIS's i32.
    assert error_of({"method": "SAMPLE", "sampling": {"topK": 2**31}}) == (
        "top_k must be strictly positive"
    )
    assert params_of({"method": "SAMPLE", "sampling": {"topK": 2**31 - 1}}).top_k == 2**31 - 1


def test_max_new_tokens() -> None:
    assert error_of({"stopping": {"maxNewTokens": 170}}) == "max_new_tokens must be <= 169"
    limits = Limits(max_sequence_length=4096, max_new_tokens=1024)
    with pytest.raises(ValidationError, match=r"^max_new_tokens must be <= 1024$"):
        request_parameters(batch({"stopping": {"maxNewTokens": 1025}}), limits)
    assert params_of({"stopping": {"maxNewTokens": 169}}).max_new_tokens == 169


def test_min_new_tokens() -> None:
    msg = "min_new_tokens must be <= max_new_tokens"
    assert error_of({"stopping": {"minNewTokens": 21}}) == msg  # against the default 20
    assert error_of({"stopping": {"maxNewTokens": 100, "minNewTokens": 101}}) == msg
    assert params_of({"stopping": {"minNewTokens": 20}}).min_new_tokens == 20


def test_repetition_penalty() -> None:
    assert error_of({"decoding": {"repetitionPenalty": -1.0}}) == (
        "repetition_penalty must be > 0.0"
    )
    assert params_of({"decoding": {"repetitionPenalty": 0.0}}).repetition_penalty == 1.0


def test_length_penalty() -> None:
    msg = "length_penalty must be >= 1.0 and <= 10.0"
    for decay in (0.5, 10.5, 0.0):
        lp = {"lengthPenalty": {"startIndex": 5, "decayFactor": decay}}
        assert error_of({"decoding": lp}) == msg
    for decay in (1.0, 10.0):
        lp = {"lengthPenalty": {"startIndex": 5, "decayFactor": decay}}
        assert params_of({"decoding": lp}).length_penalty == LengthPenalty(5, decay)


def test_too_many_stop_sequences() -> None:
    assert error_of({"stopping": {"stopSequences": [str(i) for i in range(7)]}}) == STOP_MSG
    assert len(params_of({"stopping": {"stopSequences": list("abcdef")}}).stop_sequences) == 6


def test_token_detail() -> None:
    for flag in ({"tokenLogprobs": True}, {"tokenRanks": True}, {"topNTokens": 2}):
        assert error_of({"response": flag}) == DETAIL_MSG
        for tokens in ({"generatedTokens": True}, {"inputTokens": True}):
            params_of({"response": flag | tokens})


def test_bad_stop_sequence() -> None:
    assert error_of({"stopping": {"stopSequences": ["ok", ""]}}) == STOP_MSG
    assert error_of({"stopping": {"stopSequences": ["x" * 241]}}) == STOP_MSG
    # The limit is in UTF-8 bytes: 61 four-byte emoji are 244 bytes, 60 are 240.
    assert error_of({"stopping": {"stopSequences": ["😀" * 61]}}) == STOP_MSG
    assert params_of({"stopping": {"stopSequences": ["😀" * 60, "x" * 240]}})


def test_prefix_lookup_message() -> None:
    err = prefix_lookup_error("invalid_prefix_id", prefix_not_found_reason("invalid_prefix_id"))
    assert err.message == (
        "can't retrieve prompt prefix with id 'invalid_prefix_id': "
        'prefix id "invalid_prefix_id" not found'
    )


def test_tokenizer_message() -> None:
    assert tokenizer_error("bad input").message == "tokenizer error bad input"


# Beyond TGIS (docs/deployment.md, "Request limits"): non-finite floats, top_n_tokens, quoted
# user text, input size.

NAN, INF, NEG_INF = "NaN", "Infinity", "-Infinity"  # json_format spells them as strings


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"method": "SAMPLE", "sampling": {"temperature": NAN}}, "temperature must be >= 0.05"),
        ({"method": "SAMPLE", "sampling": {"temperature": INF}}, "temperature must be >= 0.05"),
        (
            {"method": "SAMPLE", "sampling": {"temperature": NEG_INF}},
            "temperature must be >= 0.05",
        ),
        ({"method": "SAMPLE", "sampling": {"topP": NAN}}, "top_p must be > 0.0 and <= 1.0"),
        ({"method": "SAMPLE", "sampling": {"topP": INF}}, "top_p must be > 0.0 and <= 1.0"),
        ({"method": "SAMPLE", "sampling": {"typicalP": NAN}}, "typical_p must be <= 1.0"),
        ({"method": "SAMPLE", "sampling": {"typicalP": INF}}, "typical_p must be <= 1.0"),
        ({"method": "SAMPLE", "sampling": {"typicalP": NEG_INF}}, "typical_p must be <= 1.0"),
        ({"decoding": {"repetitionPenalty": NAN}}, "repetition_penalty must be > 0.0"),
        ({"decoding": {"repetitionPenalty": INF}}, "repetition_penalty must be > 0.0"),
        ({"decoding": {"repetitionPenalty": NEG_INF}}, "repetition_penalty must be > 0.0"),
        (
            {"decoding": {"lengthPenalty": {"startIndex": 2, "decayFactor": NAN}}},
            "length_penalty must be >= 1.0 and <= 10.0",
        ),
        (
            {"decoding": {"lengthPenalty": {"startIndex": 2, "decayFactor": INF}}},
            "length_penalty must be >= 1.0 and <= 10.0",
        ),
    ],
)
def test_non_finite_floats_get_their_field_message(params: dict[str, Any], message: str) -> None:
    # Through a float32 serialization round trip, as a client would send them.
    assert error_of(params) == message


def test_non_finite_sampling_floats_are_ignored_in_greedy_mode() -> None:
    # GREEDY ignores `sampling` entirely (TGIS's conversion), NaN included: nothing reaches the
    # engine.
    assert params_of({"sampling": {"temperature": NAN, "topP": NAN}}).greedy


def test_top_n_tokens_bound() -> None:
    response = {"generatedTokens": True, "topNTokens": 11}
    assert error_of({"response": response}) == "top_n_tokens (11) must be <= 10"
    response["topNTokens"] = 1_000_000_000
    assert error_of({"response": response}) == "top_n_tokens (1000000000) must be <= 10"
    assert params_of({"response": {"inputTokens": True, "topNTokens": 10}}).top_n_tokens == 10


def test_clip() -> None:
    assert clip("short") == "short"
    assert clip("x" * 256) == "x" * 256
    assert clip("x" * 1000) == "x" * 256 + "…"
    # Never half a character: 85 three-byte characters are 255 bytes.
    assert clip("€" * 1000) == "€" * 85 + "…"
    assert clip("abcdef", max_bytes=4) == "abcdef"[:4] + "…"


def test_messages_quoting_user_text_are_bounded() -> None:
    huge = "p" * 1_000_000
    message = prefix_lookup_error(huge, prefix_not_found_reason(huge)).message
    assert len(message.encode()) < 1024
    assert message.startswith("can't retrieve prompt prefix with id '" + "p" * 256 + "…'")
    assert message.endswith('prefix id "' + "p" * 256 + '…" not found')
    assert len(tokenizer_error("t" * 100_000).message.encode()) < 300


def test_input_size_limit() -> None:
    limits = Limits(max_sequence_length=256, max_new_tokens=100)
    assert limits.max_input_bytes == 256 * 1024  # the floor
    assert Limits(max_sequence_length=8192, max_new_tokens=100).max_input_bytes == 64 * 8192
    check_input_size("x" * limits.max_input_bytes, limits)
    check_input_size("😀" * (limits.max_input_bytes // 4), limits)
    with pytest.raises(ValidationError) as info:
        check_input_size("😀" * (limits.max_input_bytes // 4) + "x", limits)
    assert info.value.message == (
        "input text is 262145 UTF-8 bytes, more than the 262144 allowed per input"
    )


def test_input_too_long() -> None:
    assert error_of(None, tokens=200) == "input tokens (200) plus prefix length (0) must be < 200"
    with pytest.raises(ValidationError) as info:
        validated(None, 190, prefix_length=10)
    assert info.value.message == "input tokens (190) plus prefix length (10) must be < 200"


def test_input_plus_min_too_long() -> None:
    stopping = {"stopping": {"maxNewTokens": 169, "minNewTokens": 150}}
    assert error_of(stopping, tokens=69) == (
        "input tokens (69) plus prefix length (0) plus min_new_tokens (150) must be <= 200"
    )
    ok = validated(stopping, 50)
    assert (ok.params.min_new_tokens, ok.params.max_new_tokens) == (150, 150)
    assert ok.params.max_is_token_limit


def test_missing_request() -> None:
    with pytest.raises(ValidationError) as info:
        request_parameters(pb.SingleGenerationRequest(model_id="x"), LIMITS)
    assert info.value.message == "missing request"


def test_unknown_decoding_method() -> None:
    """A method number DecodingMethod does not define fails, whatever else the request holds;
    GREEDY and SAMPLE pass."""
    for method in (2, 5, -1):
        request = pb.BatchedGenerationRequest(params=pb.Parameters(method=method))
        with pytest.raises(ValidationError) as info:
            request_parameters(request, LIMITS)
        assert info.value.message == f"method ({method}) must be GREEDY (0) or SAMPLE (1)"
    for method in (pb.GREEDY, pb.SAMPLE):
        request = pb.BatchedGenerationRequest(params=pb.Parameters(method=method))
        assert request_parameters(request, LIMITS).greedy == (method == pb.GREEDY)


def test_check_order() -> None:
    """With several problems, the first in TGIS's order is reported."""
    sample = {"method": "SAMPLE", "sampling": {"temperature": 0.01, "topP": 2.0, "typicalP": 2.0}}
    assert error_of(sample) == "temperature must be >= 0.05"
    assert error_of(sample | {"sampling": {"topP": 2.0, "typicalP": 2.0}}) == (
        "top_p must be > 0.0 and <= 1.0"
    )
    assert error_of(
        {
            "stopping": {"maxNewTokens": 170, "minNewTokens": 171},
            "decoding": {"repetitionPenalty": -1},
        }
    ) == ("max_new_tokens must be <= 169")
    # >6 stop sequences precede token detail, which precedes an empty stop sequence.
    detail = {"response": {"tokenRanks": True}}
    seven = {"stopping": {"stopSequences": list("abcdefg")}}
    assert error_of(detail | seven) == STOP_MSG
    assert error_of(detail | {"stopping": {"stopSequences": [""]}}) == DETAIL_MSG
    # Parameter errors come before length errors.
    assert error_of({"decoding": {"repetitionPenalty": -1}}, tokens=500) == (
        "repetition_penalty must be > 0.0"
    )


# TGIS's conversion.


def test_defaults_without_params() -> None:
    expected = DecodingParams(
        greedy=True,
        temperature=0.0,
        max_new_tokens=20,
        min_new_tokens=0,
        stop_sequences=(),
        include_stop_sequence=None,
        seed=None,
    )
    assert params_of(None) == expected
    assert params_of({}) == expected
    assert params_of({"stopping": {}, "response": {}, "decoding": {}, "sampling": {}}) == expected
    assert convert_parameters(None) == expected


def test_sample_conversion() -> None:
    p = params_of({"method": "SAMPLE"})
    assert (p.greedy, p.temperature, p.top_k, p.top_p, p.typical_p, p.seed) == (
        False,
        1.0,
        0,
        1.0,
        1.0,
        None,
    )
    sampling = {"temperature": 0.7, "topK": 20, "topP": 0.9, "typicalP": 0.8, "seed": 99}
    p = params_of({"method": "SAMPLE", "sampling": sampling})
    assert (p.greedy, p.temperature, p.top_k, p.top_p, p.typical_p, p.seed) == (
        False,
        f32(0.7),
        20,
        f32(0.9),
        f32(0.8),
        99,
    )
    assert params_of({"method": "SAMPLE", "sampling": {"seed": 0}}).seed == 0  # presence, not value


def test_greedy_ignores_sampling() -> None:
    sampling = {"temperature": 0.7, "topK": 20, "topP": 0.9, "typicalP": 0.8, "seed": 99}
    assert params_of({"method": "GREEDY", "sampling": sampling}) == DecodingParams()


def test_stopping_conversion() -> None:
    stopping = {
        "maxNewTokens": 0,
        "minNewTokens": 3,
        "timeLimitMillis": 200,
        "stopSequences": ["\n\n", "END"],
    }
    p = params_of({"stopping": stopping})
    assert (p.max_new_tokens, p.min_new_tokens, p.time_limit_millis) == (20, 3, 200)
    assert p.stop_sequences == ("\n\n", "END")
    assert p.include_stop_sequence is None
    for include in (True, False):
        stopping = {"includeStopSequence": include}
        assert params_of({"stopping": stopping}).include_stop_sequence is include


def test_decoding_conversion() -> None:
    p = params_of({"decoding": {"repetitionPenalty": 1.2}})
    assert (p.repetition_penalty, p.length_penalty) == (f32(1.2), None)
    # length_penalty is taken whether or not repetition_penalty is set.
    p = params_of({"decoding": {"lengthPenalty": {"startIndex": 10, "decayFactor": 1.5}}})
    assert (p.repetition_penalty, p.length_penalty) == (1.0, LengthPenalty(10, 1.5))


def test_response_and_truncation_conversion() -> None:
    response = {
        "inputText": True,
        "generatedTokens": True,
        "inputTokens": True,
        "tokenLogprobs": True,
        "tokenRanks": True,
        "topNTokens": 5,
    }
    p = params_of({"response": response, "truncateInputTokens": 50})
    assert (p.input_text, p.generated_tokens, p.input_tokens) == (True, True, True)
    assert (p.token_logprobs, p.token_ranks, p.top_n_tokens) == (True, True, 5)
    assert p.truncate_input_tokens == 50


def test_decoding_params_is_protobuf_free() -> None:
    sampling = {"temperature": 0.7, "topK": 5, "seed": 1}
    full = {
        "method": "SAMPLE",
        "sampling": sampling,
        "decoding": {"lengthPenalty": {"startIndex": 1, "decayFactor": 2.0}},
        "stopping": {"stopSequences": ["a"], "includeStopSequence": False},
        "response": {"generatedTokens": True, "topNTokens": 1},
    }
    p = params_of(full)
    plain = (bool, int, float, str, tuple, type(None))
    for field in dataclasses.fields(p):
        value = getattr(p, field.name)
        assert isinstance(value, plain), field.name
        if isinstance(value, tuple):
            assert all(isinstance(v, int | float | str) for v in value), field.name
    assert dataclasses.replace(p) == p
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_new_tokens = 3  # type: ignore[misc]


def test_decoding_params_invariant() -> None:
    with pytest.raises(ValueError):
        DecodingParams(greedy=False)
    with pytest.raises(ValueError):
        DecodingParams(temperature=0.5)
    DecodingParams(greedy=False, temperature=0.5)


def test_limits() -> None:
    with pytest.raises(ValueError):
        Limits(max_sequence_length=0, max_new_tokens=1)
    with pytest.raises(ValueError):
        Limits(max_sequence_length=10, max_new_tokens=0)


# Per-input finalisation: truncation, TOKEN_LIMIT clamping, seeds.


def test_token_limit_clamping() -> None:
    v = validated({"stopping": {"maxNewTokens": 100}}, 186)
    assert (v.input_length, v.params.max_new_tokens, v.params.max_is_token_limit) == (
        186,
        14,
        True,
    )
    params = {"stopping": {"maxNewTokens": 100, "minNewTokens": 2}}
    v = validated(params, 198)
    assert (v.params.max_new_tokens, v.params.max_is_token_limit) == (2, True)
    v = validated({"stopping": {"maxNewTokens": 100}}, 100)
    assert (v.params.max_new_tokens, v.params.max_is_token_limit) == (100, False)
    v = validated(None, 150, prefix_length=40)
    assert (v.prefix_length, v.params.max_new_tokens, v.params.max_is_token_limit) == (40, 10, True)


def test_truncation() -> None:
    v = validated({"truncateInputTokens": 50}, 250)
    assert (v.input_length, v.params.truncate_input_tokens) == (50, 50)
    # Truncation that would not shorten the input is dropped.
    v = validated({"truncateInputTokens": 50}, 40)
    assert (v.input_length, v.params.truncate_input_tokens) == (40, 0)
    v = validated({"truncateInputTokens": 1}, 1)
    assert (v.input_length, v.params.truncate_input_tokens) == (1, 0)


def test_seeds() -> None:
    # The servicer validates each input of a call with the call's parameters.
    sample = params_of({"method": "SAMPLE", "sampling": {"topK": 20}})
    rng = random.Random(0)
    inputs = [validate_input(sample, 5, LIMITS, rng=rng) for _ in range(5)]
    seeds = [v.params.seed for v in inputs]
    assert all(s is not None and 0 <= s <= 4294967295 for s in seeds)
    assert len(set(seeds)) == 5  # one independent seed per input
    inputs = [validate_input(sample, 5, LIMITS) for _ in range(3)]  # OS entropy
    assert all(v.params.seed is not None for v in inputs)
    fixed = params_of({"method": "SAMPLE", "sampling": {"seed": 99}})
    inputs = [validate_input(fixed, 5, LIMITS) for _ in range(3)]
    assert [v.params.seed for v in inputs] == [99, 99, 99]
    assert validated(None, 5).params.seed is None  # greedy


def test_validate_input_leaves_params_alone() -> None:
    params = params_of({"method": "SAMPLE", "stopping": {"maxNewTokens": 100}})
    v = validate_input(params, 190, LIMITS, rng=random.Random(1))
    assert v == ValidatedInput(
        190,
        0,
        dataclasses.replace(params, seed=v.params.seed, max_new_tokens=10, max_is_token_limit=True),
    )
    assert (params.seed, params.max_new_tokens) == (None, 100)


def test_first_bad_input_fails_the_call(tokenizer: Any) -> None:
    """The servicer's InputPreparer validates a call's inputs in order; the first invalid one
    is the call's error."""
    preparer = InputPreparer(tokenizer, LIMITS, ServerMetrics(200, 169, 8))
    lengths = [len(tokenizer(t)["input_ids"]) for t in ("hi", " a" * 250, " b" * 300)]
    assert lengths[0] < 200 <= lengths[1] < lengths[2]
    with pytest.raises(ValidationError) as info:
        preparer.prepare_all(["hi", " a" * 250, " b" * 300], params_of(None))
    assert info.value.message == (
        f"input tokens ({lengths[1]}) plus prefix length (0) must be < 200"
    )


def test_single_request_round_trip() -> None:
    """sample_client's request (the client flow), serialized and parsed back."""
    body = {
        "model_id": "dummy-model-name",
        "request": {"text": "hello"},
        "params": {"method": "GREEDY", "stopping": {"max_new_tokens": 100, "min_new_tokens": 100}},
    }
    msg = json_format.ParseDict(body, pb.SingleGenerationRequest())
    msg = pb.SingleGenerationRequest.FromString(msg.SerializeToString())
    v = validate_input(request_parameters(msg, LIMITS), 60, LIMITS)
    assert v.input_length == 60
    assert (v.params.greedy, v.params.min_new_tokens, v.params.max_new_tokens) == (True, 100, 100)
    assert not v.params.max_is_token_limit


def test_validate_parameters_on_plain_params() -> None:
    """The engine may build DecodingParams directly; the same checks apply."""
    validate_parameters(DecodingParams(), LIMITS)
    with pytest.raises(ValidationError, match=r"^min_new_tokens must be <= max_new_tokens$"):
        validate_parameters(DecodingParams(min_new_tokens=30), LIMITS)
