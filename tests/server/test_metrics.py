"""`GET /metrics` of the real server against TGIS's metric table (IBM TGIS's router).

Every metric of the reference's table must be exposed under its name and kind, and the values
must follow the requests sent: counts and token sums against the requests' own parameters and
the tokenizer's counts, durations against each other.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf import json_format
from transformers import AutoTokenizer

from engine.paths import model_path
from server.pb import generation_pb2 as pb
from server.pb import generation_pb2_grpc
from tests.reference import require_model
from tools.server_process import ServerProcess
from training.prompts import CHAT_PROMPTS

MODEL = "tiny-llama-gqa-tied"

# TGIS's metric table: (name, kind) for every metric but NOT_REPORTED.
REFERENCE_METRICS = [
    ("tgi_request_count", "counter"),
    ("tgi_request_input_count", "counter"),
    ("tgi_request_failure", "counter"),
    ("tgi_request_success", "counter"),
    ("tgi_request_max_new_tokens", "histogram"),
    ("tgi_request_input_length", "histogram"),
    ("tgi_request_raw_input_length", "summary"),
    ("tgi_request_mean_time_per_token_duration", "histogram"),
    ("tgi_request_validation_duration", "histogram"),
    ("tgi_request_queue_duration", "histogram"),
    ("tgi_request_generated_tokens", "histogram"),
    ("tgi_request_total_tokens", "histogram"),
    ("tgi_request_duration", "histogram"),
    ("tgi_request_inference_duration", "histogram"),
    ("tgi_batch_concatenation_count", "counter"),
    ("tgi_batch_inference_count", "counter"),
    ("tgi_batch_inference_success", "counter"),
    ("tgi_batch_inference_failure", "counter"),
    ("tgi_batch_inference_batch_size", "histogram"),
    ("tgi_batch_inference_duration", "histogram"),
    ("tgi_batch_inference_forward_duration", "histogram"),
    ("tgi_batch_inference_tokproc_duration", "histogram"),
    ("tgi_batch_next_tokens", "summary"),
    ("tgi_batch_current_size", "gauge"),
    ("tgi_batch_input_tokens", "gauge"),
    ("tgi_batch_max_remaining_tokens", "gauge"),
    ("tgi_queue_size", "gauge"),
    ("tgi_prompt_load_failure", "counter"),
    ("tgi_prompt_load_duration", "histogram"),
    ("tgi_tokenize_request_count", "counter"),
    ("tgi_tokenize_request_input_count", "counter"),
    ("tgi_tokenize_request_tokens", "histogram"),
    ("tgi_tokenize_request_duration", "histogram"),
]

NOT_REPORTED = [
    "tgi_queue_jump",
    "tgi_granular_batch_addition",
    "tgi_prefill_weight_limit_exceeded",
    "tgi_prefill_padding_limit_exceeded",
]
"""TGIS metrics whose concept does not exist here (README.md lists them and why)."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    require_model(model_path(MODEL))
    env = {"MAX_SEQUENCE_LENGTH": "256", "KV_CACHE_BLOCKS": "64", "OMP_NUM_THREADS": "1"}
    log = tmp_path_factory.mktemp("metrics") / "server.log"
    with ServerProcess(MODEL, env, log) as server:
        yield server


def samples(server: ServerProcess) -> dict[str, float]:
    """Every sample of /metrics by its exposed name with labels, e.g. `a_total{k="v"}`."""
    out = {}
    for line in server.metrics_text().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_every_reference_metric_is_exposed(server: ServerProcess) -> None:
    text = server.metrics_text()
    for name, kind in REFERENCE_METRICS:
        exposed = f"{name}_total" if kind == "counter" else name
        assert re.search(rf"^# TYPE {exposed} {kind}$", text, re.MULTILINE), f"{name} ({kind})"
        if kind == "counter":
            assert re.search(rf"^# TYPE {name} untyped$", text, re.MULTILINE), f"plain {name}"
    values = samples(server)
    assert values["tgi_prompt_load_failure"] == values["tgi_prompt_load_failure_total"] == 0
    for name in NOT_REPORTED:
        assert name not in text


def test_values_follow_the_requests(server: ServerProcess) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(model_path(MODEL)))
    texts = [CHAT_PROMPTS[0], CHAT_PROMPTS[17], "Hello"]
    truncate = 12
    lengths = [len(tokenizer(t)["input_ids"]) for t in texts]
    kept = [min(n, truncate) for n in lengths]
    n_new = 9
    params: dict[str, Any] = {
        "truncate_input_tokens": truncate,
        "stopping": {"max_new_tokens": n_new, "min_new_tokens": n_new},
    }
    before = samples(server)
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        running = json_format.ParseDict(
            {
                "request": {"text": "Keep going"},
                "params": {"stopping": {"max_new_tokens": 60, "min_new_tokens": 60}},
            },
            pb.SingleGenerationRequest(),
        )
        call = stub.GenerateStream(running, timeout=60)
        next(call)
        next(call)  # the stream runs: the batch below joins it
        batch = json_format.ParseDict(
            {"requests": [{"text": t} for t in texts], "params": params},
            pb.BatchedGenerationRequest(),
        )
        stub.Generate(batch, timeout=60)
        streamed = list(call)
        with pytest.raises(grpc.RpcError):
            stub.Generate(
                json_format.ParseDict(
                    {"requests": [{"text": "x"}], "params": {"stopping": {"max_new_tokens": 9999}}},
                    pb.BatchedGenerationRequest(),
                )
            )
        tokenize = pb.BatchedTokenizeRequest(
            requests=[pb.TokenizeRequest(text=t) for t in texts[:2]]
        )
        stub.Tokenize(tokenize)
    assert streamed[-1].generated_token_count == 60
    after = samples(server)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    stream_input = len(tokenizer("Keep going")["input_ids"])
    assert delta('tgi_request_count_total{kind="batch"}') == 1
    assert delta('tgi_request_count_total{kind="single"}') == 1  # the invalid one
    assert delta('tgi_request_count_total{kind="stream"}') == 1
    assert delta('tgi_request_count{kind="stream"}') == 1
    assert delta("tgi_request_input_count_total") == 5
    assert delta('tgi_request_success_total{kind="batch",stop_reason="MAX_TOKENS"}') == 3
    assert delta('tgi_request_success_total{kind="stream",stop_reason="MAX_TOKENS"}') == 1
    assert delta('tgi_request_failure_total{err="validation"}') == 1
    assert delta("tgi_request_raw_input_length_sum") == sum(lengths) + stream_input
    assert delta("tgi_request_input_length_sum") == sum(kept) + stream_input
    assert delta("tgi_request_max_new_tokens_sum") == 3 * n_new + 60
    assert delta("tgi_request_generated_tokens_sum") == 3 * n_new + 60
    assert delta("tgi_request_total_tokens_sum") == sum(kept) + stream_input + 3 * n_new + 60
    for name in (
        "tgi_request_duration",
        "tgi_request_queue_duration",
        "tgi_request_inference_duration",
        "tgi_request_mean_time_per_token_duration",
    ):
        assert delta(f"{name}_count") == 4, name
    inference = delta("tgi_request_inference_duration_sum")
    queue = delta("tgi_request_queue_duration_sum")
    assert inference > 0 and queue >= 0
    assert queue + inference <= delta("tgi_request_duration_sum")
    per_token = delta("tgi_request_mean_time_per_token_duration_sum")
    assert per_token < inference / n_new and per_token > inference / 60
    assert delta("tgi_batch_next_tokens_sum") == sum(kept) + stream_input
    assert delta("tgi_batch_next_tokens_count") == 2
    assert delta("tgi_batch_concatenation_count_total") == 1
    steps = sum(
        delta(f'tgi_batch_inference_count_total{{method="{m}"}}') for m in ("prefill", "next_token")
    )
    assert steps >= 60
    assert (
        sum(
            delta(f'tgi_batch_inference_success_total{{method="{m}"}}')
            for m in ("prefill", "next_token")
        )
        == steps
    )
    for name in ("duration", "forward_duration", "tokproc_duration"):
        observed = sum(
            delta(f'tgi_batch_inference_{name}_count{{makeup="single_only",method="{m}"}}')
            for m in ("prefill", "next_token")
        )
        assert observed == steps, name
    for gauge in (
        "tgi_batch_current_size",
        "tgi_batch_input_tokens",
        "tgi_batch_max_remaining_tokens",
        "tgi_queue_size",
        "tgi_kv_cache_blocks_used",
    ):
        assert after[gauge] == 0, gauge
    assert delta("tgi_tokenize_request_count_total") == 1
    assert delta("tgi_tokenize_request_input_count_total") == 2
    assert delta("tgi_tokenize_request_tokens_sum") == sum(lengths[:2])


def test_gauges_while_a_request_runs(server: ServerProcess) -> None:
    """While one long stream runs: batch size 1, its tokens and remaining budget (set one
    after the other after each step, so a scrape may fall between the two: off by one)."""
    request = json_format.ParseDict(
        {
            "request": {"text": "Count the tokens"},
            "params": {"stopping": {"max_new_tokens": 200, "min_new_tokens": 200}},
        },
        pb.SingleGenerationRequest(),
    )
    prompt_len = len(
        AutoTokenizer.from_pretrained(str(model_path(MODEL)))("Count the tokens")["input_ids"]
    )
    seen: dict[str, float] = {}
    with grpc.insecure_channel(server.grpc_target) as channel:
        call = generation_pb2_grpc.GenerationServiceStub(channel).GenerateStream(request)
        messages = []
        for message in call:
            messages.append(message)
            if len(messages) == 4:
                seen = samples(server)
    size = seen["tgi_batch_current_size"]
    assert size == 1
    tokens = seen["tgi_batch_input_tokens"]
    remaining = seen["tgi_batch_max_remaining_tokens"]
    assert prompt_len < tokens <= prompt_len + 200
    assert abs(tokens - prompt_len + remaining - 200) <= 1
    assert messages[-1].generated_token_count == 200


def test_prefix_cache_hits_are_counted(server: ServerProcess) -> None:
    """The same prompt twice, one after the other: the second takes every whole block of its
    prompt but the last token from the prefix cache, and generates the same tokens."""
    text = " ".join(CHAT_PROMPTS[:8])
    num_tokens = len(AutoTokenizer.from_pretrained(str(model_path(MODEL)))(text)["input_ids"])
    request = json_format.ParseDict(
        {
            "requests": [{"text": text}],
            "params": {
                "stopping": {"max_new_tokens": 8},
                "response": {"generated_tokens": True},
            },
        },
        pb.BatchedGenerationRequest(),
    )
    outputs = []
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        for _ in range(2):
            before = samples(server)
            outputs.append([t.text for t in stub.Generate(request).responses[0].tokens])
            hits = samples(server)["tgi_prefix_cache_hit_tokens_total"]
    assert num_tokens > 32
    assert hits - before["tgi_prefix_cache_hit_tokens_total"] == (num_tokens - 1) // 16 * 16
    assert outputs[0] == outputs[1] and len(outputs[0]) == 8


def test_preemptions_are_counted(server: ServerProcess) -> None:
    """Eight 200-token requests need about 104 blocks of the pool's 64: running requests are
    preempted and recomputed. Each output still equals its solo output, the KV pool empties,
    and tgi_request_preemptions counts them."""
    batch = json_format.ParseDict(
        {
            "requests": [{"text": text} for text in CHAT_PROMPTS[:8]],
            "params": {"stopping": {"max_new_tokens": 200, "min_new_tokens": 200}},
        },
        pb.BatchedGenerationRequest(),
    )
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        solo = []
        for request in batch.requests:
            single = pb.BatchedGenerationRequest(requests=[request], params=batch.params)
            solo.append(stub.Generate(single).responses[0].text)
        before = samples(server)["tgi_request_preemptions_total"]
        together = [r.text for r in stub.Generate(batch).responses]
    after = samples(server)
    assert together == solo
    assert after["tgi_request_preemptions_total"] > before
    assert after["tgi_request_preemptions"] == after["tgi_request_preemptions_total"]
    assert after["tgi_kv_cache_blocks_used"] == 0
