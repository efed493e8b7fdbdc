"""The real server end to end: `python -m server.main` on loopback ports with a tiny model.

One server process serves the module (tiny random Llama, 64 KV blocks of 16 tokens). Greedy
output is checked against transformers; stream framing, batching invariance, validation
errors, cancellation (KV blocks freed), Tokenize/ModelInfo, /health, /metrics and SIGTERM against
TGIS's rules (docs/tgis-compatibility.md).
"""

from __future__ import annotations

import re
import signal
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import torch
from google.protobuf import json_format
from transformers import AutoTokenizer

from engine.paths import model_path
from server.pb import generation_pb2 as pb
from server.pb import generation_pb2_grpc
from tests.reference import compare_greedy, hf_greedy, hf_model
from tests.server.grpc_helpers import running_server
from tools.server_process import ServerProcess
from training.prompts import CHAT_PROMPTS

MODEL = "tiny-llama-gqa-tied"
MAX_SEQ = 256
MAX_NEW = 128
MAX_CONCURRENT = 8


@dataclass
class Server:
    process: ServerProcess
    stub: generation_pb2_grpc.GenerationServiceStub

    def metric(self, name: str) -> float:
        return self.process.metric(name)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    env = {
        "KV_CACHE_BLOCKS": "64",
        "MAX_SEQUENCE_LENGTH": str(MAX_SEQ),
        "MAX_NEW_TOKENS": str(MAX_NEW),
        "MAX_BATCH_SIZE": "8",
        "MAX_CONCURRENT_REQUESTS": str(MAX_CONCURRENT),
        "SHUTDOWN_GRACE_SECONDS": "10",
        "OMP_NUM_THREADS": "1",
    }
    log = tmp_path_factory.mktemp("server") / "server.log"
    with running_server(MODEL, env, log) as running:
        yield Server(running.process, running.stub)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(str(model_path(MODEL)))


def generate(server: Server, texts: list[str], **params: Any) -> list[dict[str, Any]]:
    request = json_format.ParseDict(
        {"requests": [{"text": t} for t in texts], "params": params},
        pb.BatchedGenerationRequest(),
    )
    response = server.stub.Generate(request, timeout=60)
    return [json_format.MessageToDict(r) for r in response.responses]


def stream(server: Server, text: str, **params: Any) -> list[dict[str, Any]]:
    request = json_format.ParseDict(
        {"request": {"text": text}, "params": params}, pb.SingleGenerationRequest()
    )
    return [json_format.MessageToDict(m) for m in server.stub.GenerateStream(request, timeout=60)]


def test_greedy_generate_matches_transformers(server: Server, tokenizer: Any) -> None:
    texts = CHAT_PROMPTS[:4]
    results = generate(
        server, texts, stopping={"max_new_tokens": 24}, response={"generated_tokens": True}
    )
    for text, result in zip(texts, results, strict=True):
        prompt = tuple(tokenizer(text)["input_ids"])
        ours = tokenizer.convert_tokens_to_ids([t["text"] for t in result["tokens"]])
        ref = hf_greedy(model_path(MODEL), prompt, 24)
        near_tie = compare_greedy(ours, ref)
        assert result["inputTokenCount"] == len(prompt)
        assert result["generatedTokenCount"] == len(ours)
        if not near_tie:
            assert result.get("text", "") == tokenizer.decode(ours, skip_special_tokens=True)
        eos = ours[-1] == tokenizer.eos_token_id
        assert result["stopReason"] == ("EOS_TOKEN" if eos else "MAX_TOKENS")


def test_token_logprobs_ranks_and_top_tokens(server: Server, tokenizer: Any) -> None:
    response = {"generated_tokens": True, "token_logprobs": True, "token_ranks": True}
    (result,) = generate(
        server,
        [CHAT_PROMPTS[0]],
        stopping={"max_new_tokens": 8, "min_new_tokens": 8},
        response={**response, "top_n_tokens": 3},
    )
    ref = hf_greedy(model_path(MODEL), tuple(tokenizer(CHAT_PROMPTS[0])["input_ids"]), 8)
    for i, token in enumerate(result["tokens"]):
        ref_logprobs = ref.logits[i].log_softmax(-1)
        token_id = tokenizer.convert_tokens_to_ids(token["text"])
        assert token["rank"] == 1
        assert token["logprob"] == pytest.approx(ref_logprobs[token_id].item(), abs=1e-3)
        top = token["topTokens"]
        assert len(top) >= 3 and top[0]["text"] == token["text"]
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
    (plain,) = generate(
        server,
        [CHAT_PROMPTS[0]],
        stopping={"max_new_tokens": 8, "min_new_tokens": 8},
        response={"generated_tokens": True, "top_n_tokens": 2},
    )
    for token in plain["tokens"]:
        ids = tokenizer.convert_tokens_to_ids([t["text"] for t in token["topTokens"]])
        assert ids == sorted(ids) and "logprob" not in token and "rank" not in token


def test_input_token_details(server: Server, tokenizer: Any) -> None:
    params = {
        "stopping": {"max_new_tokens": 2},
        "response": {"input_tokens": True, "token_logprobs": True, "token_ranks": True},
    }
    (result,) = generate(server, [CHAT_PROMPTS[3]], **params)
    prompt = tokenizer(CHAT_PROMPTS[3])["input_ids"]
    with torch.no_grad():
        logits = hf_model(model_path(MODEL))(torch.tensor([prompt])).logits[0].log_softmax(-1)
    tokens = result["inputTokens"]
    assert [t["text"] for t in tokens] == tokenizer.convert_ids_to_tokens(prompt)
    assert tokens[0] == {"text": tokens[0]["text"], "logprob": "NaN"}
    for j, token in enumerate(tokens[1:]):
        row = logits[j]
        assert token["logprob"] == pytest.approx(row[prompt[j + 1]].item(), abs=1e-3)
        assert token["rank"] == int((row > row[prompt[j + 1]]).sum()) + 1
    messages = stream(server, CHAT_PROMPTS[3], **params)
    second = messages[1]
    assert set(second) == {"inputTokenCount", "inputTokens"}
    for a, b in zip(second["inputTokens"][1:], tokens[1:], strict=True):
        assert (a["text"], a["rank"]) == (b["text"], b["rank"])
        assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)


def test_repetition_penalty_matches_transformers(server: Server, tokenizer: Any) -> None:
    prompt = tokenizer(CHAT_PROMPTS[5])["input_ids"]
    (result,) = generate(
        server,
        [CHAT_PROMPTS[5]],
        decoding={"repetition_penalty": 1.5},
        stopping={"max_new_tokens": 16},
        response={"generated_tokens": True},
    )
    model = hf_model(model_path(MODEL))
    with torch.no_grad():
        ref = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=16,
            do_sample=False,
            repetition_penalty=1.5,
            pad_token_id=tokenizer.eos_token_id,
        )[0, len(prompt) :].tolist()
    ours = tokenizer.convert_tokens_to_ids([t["text"] for t in result["tokens"]])
    assert ours == ref


def test_stream_message_rules(server: Server) -> None:
    params = {"stopping": {"max_new_tokens": 40, "min_new_tokens": 40}}
    messages = stream(server, CHAT_PROMPTS[1], **params)
    (unary,) = generate(server, [CHAT_PROMPTS[1]], **params)
    first, rest = messages[0], messages[1:]
    assert first["inputTokenCount"] == unary["inputTokenCount"] > 0
    assert "generatedTokenCount" not in first and "stopReason" not in first
    counts = [m["generatedTokenCount"] for m in rest]
    assert counts == sorted(set(counts)) and counts[-1] == 40
    for m in rest[:-1]:
        assert m["text"] and "stopReason" not in m and "inputTokenCount" not in m
    assert rest[-1]["stopReason"] == "MAX_TOKENS"
    assert "".join(m.get("text", "") for m in rest) == unary["text"]


def test_sampling_seed_is_echoed_and_deterministic(server: Server) -> None:
    params = {"method": "SAMPLE", "sampling": {"seed": 99, "top_k": 20}}
    a, b = generate(server, ["Hello there", "Hello there"], **params)
    assert a["seed"] == b["seed"] == "99" and a["text"] == b["text"]
    messages = stream(server, "Hello there", **params)
    assert messages[0]["seed"] == messages[-1]["seed"] == "99"
    assert all("seed" not in m for m in messages[1:-1])
    unseeded = generate(server, ["Hi"] * 3, method="SAMPLE")
    assert len({r["seed"] for r in unseeded}) == 3


def test_concurrent_mixed_requests_match_alone(server: Server) -> None:
    greedy = {"stopping": {"max_new_tokens": 30}}
    seeded = {"method": "SAMPLE", "sampling": {"seed": 7, "temperature": 0.8}, **greedy}
    cases = [(p, greedy) for p in CHAT_PROMPTS[4:8]] + [(CHAT_PROMPTS[8], seeded)]
    alone = [generate(server, [p], **params)[0]["text"] for p, params in cases]

    def run(i: int) -> str:
        prompt, params = cases[i % len(cases)]
        if i % 2:
            return "".join(m.get("text", "") for m in stream(server, prompt, **params))
        return str(generate(server, [prompt], **params)[0]["text"])

    with ThreadPoolExecutor(MAX_CONCURRENT) as pool:
        together = list(pool.map(run, range(2 * len(cases))))
    assert together == alone + alone


def test_stop_sequences(server: Server) -> None:
    params: dict[str, Any] = {"stopping": {"max_new_tokens": 30, "min_new_tokens": 30}}
    text = generate(server, [CHAT_PROMPTS[2]], **params)[0]["text"]
    stop = text[10:14]
    start = text.index(stop)
    params["stopping"] = {"max_new_tokens": 30, "stop_sequences": [stop]}
    included = generate(server, [CHAT_PROMPTS[2]], **params)[0]
    assert included["stopReason"] == "STOP_SEQUENCE" and included["stopSequence"] == stop
    assert included["text"] == text[: start + len(stop)]
    params["stopping"]["include_stop_sequence"] = False
    excluded = generate(server, [CHAT_PROMPTS[2]], **params)[0]
    assert excluded["text"] == text[:start]
    streamed = stream(server, CHAT_PROMPTS[2], **params)
    assert "".join(m.get("text", "") for m in streamed) == text[:start]
    assert streamed[-1]["stopReason"] == "STOP_SEQUENCE"


def test_token_limit_truncation_and_input_text(server: Server, tokenizer: Any) -> None:
    long_text = " ".join(["word"] * 300)
    n = len(tokenizer(long_text)["input_ids"])
    assert n > MAX_SEQ
    result = generate(
        server,
        [long_text],
        truncate_input_tokens=MAX_SEQ - 6,
        stopping={"max_new_tokens": 20, "min_new_tokens": 6},
        response={"input_text": True},
    )[0]
    assert result["inputTokenCount"] == MAX_SEQ - 6
    assert result["generatedTokenCount"] == 6 and result["stopReason"] == "TOKEN_LIMIT"
    assert result["text"].startswith(long_text)


def test_time_limit(server: Server) -> None:
    result = generate(
        server,
        ["Tell me a story"],
        stopping={"max_new_tokens": MAX_NEW, "min_new_tokens": MAX_NEW, "time_limit_millis": 40},
    )[0]
    assert result["stopReason"] == "TIME_LIMIT"
    assert result.get("generatedTokenCount", 0) < MAX_NEW


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"stopping": {"max_new_tokens": MAX_NEW + 1}}, f"max_new_tokens must be <= {MAX_NEW}"),
        (
            {"stopping": {"max_new_tokens": 5, "min_new_tokens": 6}},
            "min_new_tokens must be <= max_new_tokens",
        ),
        ({"method": "SAMPLE", "sampling": {"temperature": 0.02}}, "temperature must be >= 0.05"),
        (
            {"stopping": {"stop_sequences": ["a", ""]}},
            "can specify at most 6 non-empty stop sequences, each not more than 240 UTF8 bytes",
        ),
        (
            {"response": {"token_logprobs": True}},
            "must request input and/or generated tokens to request extra token detail",
        ),
        (
            {
                "stopping": {"max_new_tokens": 100, "min_new_tokens": 100},
                "truncate_input_tokens": 200,
            },
            "input tokens (200) plus prefix length (0) plus min_new_tokens (100) must be <= 256",
        ),
    ],
)
def test_validation_errors(server: Server, params: dict[str, Any], message: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        generate(server, [" ".join(["word"] * 300)], **params)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == message


def test_input_too_long_missing_request_and_empty_batch(server: Server) -> None:
    with pytest.raises(grpc.RpcError) as info:
        generate(server, [" ".join(["word"] * 300)])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.fullmatch(
        r"input tokens \(\d+\) plus prefix length \(0\) must be < 256", str(info.value.details())
    )
    with pytest.raises(grpc.RpcError) as info:
        list(server.stub.GenerateStream(pb.SingleGenerationRequest(), timeout=10))
    assert (info.value.code(), info.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "missing request",
    )
    assert server.stub.Generate(pb.BatchedGenerationRequest()) == pb.BatchedGenerationResponse()
    request = pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="x")], prefix_id="p1")
    with pytest.raises(grpc.RpcError) as info:
        server.stub.Generate(request)
    assert (
        info.value.details()
        == """can't retrieve prompt prefix with id 'p1': prefix id "p1" not found"""
    )


def test_overloaded(server: Server) -> None:
    with pytest.raises(grpc.RpcError) as info:
        generate(server, ["x"] * (MAX_CONCURRENT + 1))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.details() == "Model is overloaded"


def test_cancelled_stream_frees_kv_blocks(server: Server) -> None:
    request = json_format.ParseDict(
        {
            "request": {"text": CHAT_PROMPTS[17]},
            "params": {"stopping": {"max_new_tokens": MAX_NEW, "min_new_tokens": MAX_NEW}},
        },
        pb.SingleGenerationRequest(),
    )
    call = server.stub.GenerateStream(request, timeout=60)
    for _ in range(4):
        next(call)
    assert server.metric("tgi_kv_cache_blocks_used") > 0
    call.cancel()
    deadline = time.monotonic() + 10
    while server.metric("tgi_kv_cache_blocks_used") != 0:
        assert time.monotonic() < deadline, "KV blocks not freed after cancellation"
        time.sleep(0.05)
    assert server.metric("tgi_kv_cache_blocks_total") == 64


def test_tokenize_and_model_info(server: Server, tokenizer: Any) -> None:
    text = "Hello world, héllo 😀"
    request = pb.BatchedTokenizeRequest(
        requests=[pb.TokenizeRequest(text=text)], return_tokens=True, return_offsets=True
    )
    (result,) = server.stub.Tokenize(request).responses
    ids = tokenizer(text, return_offsets_mapping=True)
    assert result.token_count == len(ids["input_ids"])
    assert list(result.tokens) == tokenizer.convert_ids_to_tokens(ids["input_ids"])
    assert [(o.start, o.end) for o in result.offsets] == [tuple(o) for o in ids["offset_mapping"]]
    request = pb.BatchedTokenizeRequest(
        requests=[pb.TokenizeRequest(text=text)], truncate_input_tokens=2, return_tokens=True
    )
    (result,) = server.stub.Tokenize(request).responses
    assert result.token_count == 2 and not result.offsets
    assert list(result.tokens) == tokenizer.convert_ids_to_tokens(ids["input_ids"][-2:])
    info = server.stub.ModelInfo(pb.ModelInfoRequest(model_id="unused"))
    assert info.model_kind == pb.ModelInfoResponse.DECODER_ONLY
    assert (info.max_sequence_length, info.max_new_tokens) == (MAX_SEQ, MAX_NEW)


def test_health_metrics_and_log_lines(server: Server) -> None:
    assert urllib.request.urlopen(f"{server.process.http_url}/health").read() == b""
    assert server.metric("tgi_request_input_count_total") == server.metric(
        "tgi_request_input_count"
    )
    assert server.metric('tgi_request_failure_total{err="validation"}') >= 6
    log = server.process.log_text()
    assert re.search(r"gRPC server started on port \d+", log)
    assert re.search(r"HTTP server started on port \d+", log)


def test_sigterm_finishes_in_flight_and_exits_zero(server: Server) -> None:
    params = {"stopping": {"max_new_tokens": 60, "min_new_tokens": 60}}
    request = json_format.ParseDict(
        {"request": {"text": "Once upon a time"}, "params": params}, pb.SingleGenerationRequest()
    )
    call = server.stub.GenerateStream(request, timeout=60)
    next(call)
    server.process.send_signal(signal.SIGTERM)
    messages = [json_format.MessageToDict(m) for m in call]
    assert messages[-1]["generatedTokenCount"] == 60
    assert server.process.wait(timeout_s=20) == 0
