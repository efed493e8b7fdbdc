"""The OpenAI-compatible HTTP API of the real server, through the official `openai` client:
models, completions and chat (unary and streamed), n, stop, seeds, logprobs, usage, bad input
and a client that goes away. The gRPC API of the same server process is the oracle: the same
request through both APIs gives the same tokens, logprobs and text."""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from engine import LLM
from engine.paths import model_path
from tests.server.grpc_helpers import Server, running_server, single_request
from tests.server.openai_helpers import client, post
from tools.server_process import ServerProcess
from training.prompts import CHAT_PROMPTS

MODEL = "tiny-llama-gqa-tied"
ENV = {"MAX_SEQUENCE_LENGTH": "512", "KV_CACHE_BLOCKS": "256", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("openai") / "server.log"
    with running_server(MODEL, ENV, log) as server:
        yield server


@pytest.fixture(scope="module")
def oai(server: Server) -> openai.OpenAI:
    return client(server.process)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(str(model_path(MODEL)))


def chat_text(tokenizer: Any, content: str) -> str:
    """The chat template applied by hand, as the gRPC client must."""
    messages = [{"role": "user", "content": content}]
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def grpc_generate(server: Server, text: str, params: dict[str, Any]) -> Any:
    """One GenerateStream call, its messages joined: (text, tokens, stop reason, count)."""
    messages = list(server.stub.GenerateStream(single_request(text, params), timeout=60))
    tokens = [t for m in messages for t in m.tokens]
    return "".join(m.text for m in messages), tokens, messages[-1]


def test_models_lists_the_served_model(oai: openai.OpenAI) -> None:
    models = oai.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].object == "model"


def test_greedy_chat_equals_grpc_with_the_template_applied(
    server: Server, oai: openai.OpenAI, tokenizer: Any
) -> None:
    for prompt in CHAT_PROMPTS[:3]:
        reply = oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            temperature=0,
            max_tokens=24,
        )
        text, _, last = grpc_generate(
            server, chat_text(tokenizer, prompt), {"stopping": {"maxNewTokens": 24}}
        )
        (choice,) = reply.choices
        assert choice.message.content == text
        assert choice.message.role == "assistant"
        assert choice.finish_reason == ("length" if last.stop_reason == 1 else "stop")
        prompt_tokens = len(tokenizer(chat_text(tokenizer, prompt))["input_ids"])
        assert reply.usage is not None
        assert reply.usage.prompt_tokens == prompt_tokens
        assert reply.usage.completion_tokens == last.generated_token_count
        assert reply.usage.total_tokens == prompt_tokens + last.generated_token_count
        assert reply.id.startswith("chatcmpl-") and reply.model == MODEL


def test_streamed_chat_with_include_usage_equals_unary(oai: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": CHAT_PROMPTS[4]}]
    unary = oai.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=20
    )
    chunks = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=messages,
            temperature=0,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == unary.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == unary.choices[0].finish_reason and not any(finishes[:-1])
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == unary.usage
    assert len({c.id for c in chunks}) == 1


def test_completions_unary_and_streamed_equal_grpc(server: Server, oai: openai.OpenAI) -> None:
    prompt = CHAT_PROMPTS[5]
    text, _, last = grpc_generate(server, prompt, {"stopping": {"maxNewTokens": 16}})
    unary = oai.completions.create(model=MODEL, prompt=prompt, temperature=0)  # max_tokens: 16
    assert unary.choices[0].text == text
    assert unary.usage is not None and unary.usage.completion_tokens == last.generated_token_count
    stream = oai.completions.create(model=MODEL, prompt=prompt, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == text
    echoed = oai.completions.create(model=MODEL, prompt=prompt, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + text


def test_completion_logprobs_equal_grpc(server: Server, oai: openai.OpenAI, tokenizer: Any) -> None:
    prompt = CHAT_PROMPTS[6]
    reply = oai.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=12, logprobs=3
    )
    params = {
        "stopping": {"maxNewTokens": 12},
        "response": {"generatedTokens": True, "tokenLogprobs": True, "topNTokens": 3},
    }
    _, tokens, _ = grpc_generate(server, prompt, params)
    lp = reply.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    piece = tokenizer.convert_tokens_to_string
    assert lp.tokens == [piece([t.text]) for t in tokens]
    assert lp.token_logprobs == pytest.approx([t.logprob for t in tokens], abs=1e-5)
    for top, t in zip(lp.top_logprobs, tokens, strict=True):
        assert top == pytest.approx({piece([x.text]): x.logprob for x in t.top_tokens}, abs=1e-5)
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]


def test_chat_top_logprobs_equal_grpc(server: Server, oai: openai.OpenAI, tokenizer: Any) -> None:
    prompt = CHAT_PROMPTS[7]
    reply = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        max_tokens=10,
        logprobs=True,
        top_logprobs=4,
    )
    params = {
        "stopping": {"maxNewTokens": 10},
        "response": {"generatedTokens": True, "tokenLogprobs": True, "topNTokens": 4},
    }
    _, tokens, _ = grpc_generate(server, chat_text(tokenizer, prompt), params)
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == len(tokens)
    piece = tokenizer.convert_tokens_to_string
    for item, t in zip(content, tokens, strict=True):
        assert item.token == piece([t.text]) and item.bytes == list(item.token.encode())
        assert item.logprob == pytest.approx(t.logprob, abs=1e-5)
        assert [(x.token, x.logprob) for x in item.top_logprobs] == [
            (piece([x.text]), pytest.approx(x.logprob, abs=1e-5)) for x in t.top_tokens
        ]


def test_seeded_sampling_is_reproducible_and_equals_grpc(
    server: Server, oai: openai.OpenAI, tokenizer: Any
) -> None:
    prompt = CHAT_PROMPTS[8]
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0.9,
        "top_p": 0.95,
        "max_tokens": 24,
        "seed": 4242,
    }
    first = oai.chat.completions.create(**kwargs)
    again = oai.chat.completions.create(**kwargs)
    assert first.choices[0].message.content == again.choices[0].message.content
    sampling = {"temperature": 0.9, "topP": 0.95, "seed": 4242}
    params = {"method": "SAMPLE", "sampling": sampling, "stopping": {"maxNewTokens": 24}}
    text, _, _ = grpc_generate(server, chat_text(tokenizer, prompt), params)
    assert first.choices[0].message.content == text
    other = oai.chat.completions.create(**{**kwargs, "seed": 4243})
    assert other.choices[0].message.content != text


def test_n_choices_are_seeded_apart_and_reproducible(oai: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "prompt": CHAT_PROMPTS[9],
        "temperature": 1.0,
        "max_tokens": 16,
        "n": 3,
        "seed": 7,
    }
    reply = oai.completions.create(**kwargs)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    texts = [c.text for c in reply.choices]
    assert len(set(texts)) == 3
    assert [c.text for c in oai.completions.create(**kwargs).choices] == texts
    single = oai.completions.create(**{**kwargs, "n": 1})
    assert single.choices[0].text == texts[0]  # choice 0 samples with the seed itself
    streamed: dict[int, str] = {0: "", 1: "", 2: ""}
    for chunk in oai.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert [streamed[i] for i in range(3)] == texts
    assert reply.usage is not None
    prompt_tokens = oai.completions.create(**{**kwargs, "n": 1}).usage.prompt_tokens  # type: ignore[union-attr]
    assert reply.usage.prompt_tokens == prompt_tokens


def test_stop_ends_before_the_stop_string(oai: openai.OpenAI) -> None:
    prompt = CHAT_PROMPTS[10]
    free = oai.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=30)
    text = free.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    stopped = oai.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=30, stop=[stop, "\x00never"]
    )
    assert stopped.choices[0].text == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    streamed = oai.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=30, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == text[: text.index(stop)]


def test_penalties_and_logit_bias(oai: openai.OpenAI, tokenizer: Any) -> None:
    """OpenAI's penalties and logit_bias reach the engine as its own rules: the server's tokens
    equal the engine's, run in this process on the same model with the same parameters (the
    rules themselves are checked against a per-row oracle in tests/unit)."""
    prompt = CHAT_PROMPTS[11]
    favoured = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(" banana"))[0]
    biased = oai.completions.create(
        model=MODEL,
        prompt=prompt,
        temperature=0,
        max_tokens=12,
        logit_bias={str(favoured): 100},
        logprobs=0,
    )
    lp = biased.choices[0].logprobs
    assert lp is not None and lp.tokens
    favoured_text = tokenizer.convert_tokens_to_string([tokenizer.convert_ids_to_tokens(favoured)])
    assert set(lp.tokens) == {favoured_text}  # +100 outweighs every other logit
    # The tiny model's logits span far more than the penalties' +-2: four tokens biased by +100
    # each leave the choice among them to the penalties.
    llm = LLM(model_path(MODEL), dtype="float32")
    prompt_ids = tokenizer(prompt)["input_ids"]
    four = {favoured + i: 100.0 for i in range(4)}
    plain = llm.generate([prompt_ids], 12, logit_bias=four)[0].token_ids
    for rules in ({"frequency_penalty": 2.0}, {"presence_penalty": 1.5, "frequency_penalty": 0.5}):
        served = oai.completions.create(
            model=MODEL,
            prompt=prompt,
            temperature=0,
            max_tokens=12,
            logprobs=0,
            logit_bias={str(t): b for t, b in four.items()},
            **rules,
        )
        expected = llm.generate([prompt_ids], 12, logit_bias=four, **rules)[0]
        served_lp = served.choices[0].logprobs
        assert served_lp is not None
        assert served_lp.tokens == [tokenizer.decode([t]) for t in expected.token_ids], rules
        assert expected.token_ids != plain, rules  # the penalties changed the output


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
BAD_INPUTS = [
    ("missing messages", {"model": MODEL}, 400, "messages"),
    ("messages of a wrong type", {**CHAT, "messages": "Hi"}, 400, "messages"),
    ("max_tokens of a wrong type", {**CHAT, "max_tokens": "ten"}, 400, "max_tokens"),
    ("temperature NaN", {**CHAT, "temperature": math.nan}, 400, "temperature"),
    ("temperature 1e9", {**CHAT, "temperature": 1e9}, 400, "temperature"),
    ("max_tokens -1", {**CHAT, "max_tokens": -1}, 400, "max_tokens"),
    ("max_tokens beyond the model", {**CHAT, "max_tokens": 100_000}, 400, "max_tokens"),
    ("n 0", {**CHAT, "n": 0}, 400, "n"),
    ("n 10,000", {**CHAT, "n": 10_000}, 400, "n"),
    ("top_logprobs 100", {**CHAT, "logprobs": True, "top_logprobs": 100}, 400, "top_logprobs"),
    ("five stop strings", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("presence_penalty 3", {**CHAT, "presence_penalty": 3}, 400, "presence_penalty"),
    ("logit_bias beyond the vocabulary", {**CHAT, "logit_bias": {"99999999": 1}}, 400, None),
    ("an unknown model", {**CHAT, "model": "gpt-4"}, 404, "model"),
]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [case[1:] for case in BAD_INPUTS],
    ids=[case[0] for case in BAD_INPUTS],
)
def test_bad_input_gets_its_status_and_an_openai_error(
    server: Server, body: dict[str, Any], status: int, param: str | None
) -> None:
    code, reply = post(server.process, "/v1/chat/completions", body)
    assert code == status, reply
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param and param.split(".")[0] in error["message"] + param
    if status == 404:
        assert error["code"] == "model_not_found"


def test_bad_bodies(server: Server) -> None:
    path = "/v1/completions"
    code, reply = post(server.process, path, b'{"model": "x", "prompt": ')
    assert code == 400 and "JSON" in reply["error"]["message"]
    code, reply = post(server.process, path, {"model": MODEL, "prompt": "Hi"}, "text/plain")
    assert code == 415 and "application/json" in reply["error"]["message"]
    huge = {"model": MODEL, "prompt": "a" * (10 * 1024 * 1024)}
    code, reply = post(server.process, path, huge)
    assert code == 413 and "bytes" in reply["error"]["message"]
    with pytest.raises(openai.BadRequestError) as info:  # through the client too
        client(server.process).completions.create(model=MODEL, prompt="Hi", max_tokens=-1)
    assert info.value.status_code == 400 and "max_tokens" in str(info.value.body)
    assert server.process.health() == 200  # none of these harmed the server


def test_http_requests_count_in_the_tgi_metrics(server: Server, oai: openai.OpenAI) -> None:
    p = server.process
    before = p.metric('tgi_request_count_total{kind="openai_chat"}', 0.0)
    ok = p.metric('tgi_http_request_count_total{route="/v1/chat/completions",status="200"}', 0.0)
    success = 'tgi_request_success_total{kind="openai_chat",stop_reason="MAX_TOKENS"}'
    done = p.metric(success, 0.0)
    oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        extra_body={"min_tokens": 3},
    )
    assert p.metric('tgi_request_count_total{kind="openai_chat"}') == before + 1
    assert p.metric(success) == done + 1
    route = 'tgi_http_request_count_total{route="/v1/chat/completions",status="200"}'
    assert p.metric(route) == ok + 1


def test_client_gone_mid_stream_cancels_the_request(server: Server, oai: openai.OpenAI) -> None:
    p = server.process
    cancelled = p.metric('tgi_request_failure_total{err="cancelled"}', 0.0)
    success = p.metric(
        'tgi_request_success_total{kind="openai_completions_stream",stop_reason="MAX_TOKENS"}', 0.0
    )
    stream = oai.completions.create(
        model=MODEL,
        prompt=CHAT_PROMPTS[12],
        max_tokens=500,
        extra_body={"min_tokens": 500},
        stream=True,
    )
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    deadline = time.monotonic() + 20
    while p.metric('tgi_request_failure_total{err="cancelled"}', 0.0) < cancelled + 1:
        assert time.monotonic() < deadline, "the request was not cancelled"
        time.sleep(0.1)
    while p.metric("tgi_kv_cache_blocks_used") != 0:
        assert time.monotonic() < deadline, "its KV blocks were not freed"
        time.sleep(0.1)
    assert (
        p.metric(
            'tgi_request_success_total{kind="openai_completions_stream",stop_reason="MAX_TOKENS"}',
            0.0,
        )
        == success
    )


@pytest.fixture(scope="module")
def templateless_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The model with its tokenizer's chat template removed."""
    folder = tmp_path_factory.mktemp("no-template") / MODEL
    shutil.copytree(model_path(MODEL), folder)
    config = folder / "tokenizer_config.json"
    settings = json.loads(config.read_text())
    settings.pop("chat_template", None)
    config.write_text(json.dumps(settings))
    for extra in ("chat_template.jinja", "chat_template.json"):
        (folder / extra).unlink(missing_ok=True)
    log = Path(folder.parent) / "server.log"
    with ServerProcess(folder, ENV, log) as process:
        yield process


def test_chat_without_a_template_is_a_clear_400(templateless_server: ServerProcess) -> None:
    oai = client(templateless_server)
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(
            model=str(templateless_server.model), messages=[{"role": "user", "content": "Hi"}]
        )
    assert "chat template" in str(info.value.body)
    reply = oai.completions.create(model=str(templateless_server.model), prompt="Hi", max_tokens=2)
    assert reply.choices[0].text is not None
