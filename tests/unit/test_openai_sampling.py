"""The HTTP API's field mapping without a server: OpenAI's defaults and bounds, the gRPC API's
checks with OpenAI's field names, and the per-choice seeds."""

from __future__ import annotations

import pytest

from server.messages import ValidationError
from server.openai.errors import ApiError, from_validation
from server.openai.protocol import ChatCompletionRequest, CompletionRequest
from server.openai.sampling import choice_seed, sampling
from server.validation import DEFAULT_MAX_NEW_TOKENS, Limits

LIMITS = Limits(max_sequence_length=512, max_new_tokens=256)


def chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **fields}
    )


def completion(**fields: object) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "Hi", **fields})


def test_openai_defaults() -> None:
    params = sampling(chat(), LIMITS, 64, 1000).params
    assert (params.greedy, params.temperature) == (False, 1.0)  # OpenAI's default temperature
    assert params.max_new_tokens == LIMITS.max_new_tokens
    assert params.include_stop_sequence is False
    assert sampling(completion(), LIMITS, 64, 1000).params.max_new_tokens == 16
    assert DEFAULT_MAX_NEW_TOKENS != 16  # not TGIS's default
    greedy = sampling(chat(temperature=0, top_p=0.5, seed=3), LIMITS, 64, 1000).params
    assert greedy.greedy and greedy.top_p == 1.0 and greedy.seed is None


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"temperature": 0.01}, "temperature", "temperature must be >= 0.05"),
        ({"temperature": 2.5}, "temperature", "between 0 and 2"),
        ({"max_tokens": 300}, "max_tokens", "max_tokens must be <= 256"),
        ({"max_completion_tokens": 300}, "max_completion_tokens", "must be <= 256"),
        ({"top_p": 1.5}, "top_p", "top_p must be > 0.0 and <= 1.0"),
        ({"logprobs": True, "top_logprobs": 11}, "top_logprobs", "top_logprobs (11) must be"),
        ({"top_logprobs": 2}, "top_logprobs", "requires logprobs"),
        ({"stop": ["a", ""]}, "stop", "non-empty stop sequences"),
        ({"n": 65}, "n", "between 1 and 64"),
        ({"seed": 2**64}, "seed", "64-bit"),
        ({"frequency_penalty": -2.5}, "frequency_penalty", "between -2 and 2"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias", "token ids below 1000"),
        ({"logit_bias": {"5": 101.0}}, "logit_bias", "between -100 and 100"),
    ],
)
def test_refusals_name_the_openai_field(
    fields: dict[str, object], param: str, message: str
) -> None:
    with pytest.raises(ApiError) as info:
        sampling(chat(**fields), LIMITS, 64, 1000)
    assert info.value.status == 400 and info.value.param == param
    assert message in info.value.message


def test_completion_logprobs_bound_names_logprobs() -> None:
    with pytest.raises(ApiError) as info:
        sampling(completion(logprobs=11), LIMITS, 64, 1000)
    assert info.value.param == "logprobs" and info.value.message.startswith("logprobs (11)")


def test_input_length_errors_name_the_prompt() -> None:
    error = from_validation(
        ValidationError("input tokens (600) plus prefix length (0) must be < 512"),
        "messages",
        "top_logprobs",
    )
    assert error.param == "messages" and error.message.startswith("input tokens (600)")


def test_choice_seeds() -> None:
    assert choice_seed(42, 0) == 42
    seeds = {choice_seed(42, i) for i in range(100)}
    assert len(seeds) == 100 and all(0 <= s < 2**64 for s in seeds)
    assert choice_seed(42, 5) == choice_seed(42, 5) != choice_seed(43, 5)
    params = sampling(chat(seed=-1, n=3), LIMITS, 64, 1000)
    assert params.params.seed == 2**64 - 1
    assert [params.for_choice(i).seed for i in range(3)] == [
        choice_seed(2**64 - 1, i) for i in range(3)
    ]
