"""No request can harm another, against the real server as a hostile client would.

One server process serves the module (tiny random Llama): each bad request gets its documented
status while innocent greedy requests started at the same moment finish with their solo outputs;
Tokenize is bounded and does not stall other RPCs; responses stay under MAX_RESPONSE_BYTES;
undecodable bytes get INVALID_ARGUMENT with one warning; a second server on a used port exits
with one line naming it; SIGTERM past the grace period cancels streams without tracebacks.
"""

from __future__ import annotations

import functools
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from google.protobuf import json_format

from server.pb import generation_pb2 as pb
from tests.server.grpc_helpers import (
    Server,
    batch_request,
    generate_texts,
    running_server,
    status_of,
    stream_text,
)
from tools.server_process import ServerProcess
from training.prompts import CHAT_PROMPTS

MODEL = "tiny-llama-gqa-tied"
MAX_SEQ = 256
MAX_CONCURRENT = 32
MAX_RESPONSE_BYTES = 200_000
MAX_INPUT_BYTES = 256 * 1024  # server.validation: max(256 KiB, 64 B x MAX_SEQ)
ENV = {
    "KV_CACHE_BLOCKS": "512",
    "MAX_SEQUENCE_LENGTH": str(MAX_SEQ),
    "MAX_NEW_TOKENS": "200",
    "MAX_BATCH_SIZE": "8",
    "MAX_CONCURRENT_REQUESTS": str(MAX_CONCURRENT),
    "MAX_RESPONSE_BYTES": str(MAX_RESPONSE_BYTES),
    "SHUTDOWN_GRACE_SECONDS": "0.1",
    "OMP_NUM_THREADS": "1",
}
INNOCENT = {"stopping": {"max_new_tokens": 20}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    with running_server(MODEL, ENV, log) as server:
        yield server


SAMPLE = {"method": "SAMPLE"}
TOKENS = {"generated_tokens": True}
BAD_PARAMS = [
    ({**SAMPLE, "sampling": {"temperature": "NaN"}}, "temperature must be >= 0.05"),
    ({**SAMPLE, "sampling": {"temperature": "Infinity"}}, "temperature must be >= 0.05"),
    ({**SAMPLE, "sampling": {"top_p": "NaN"}}, "top_p must be > 0.0 and <= 1.0"),
    ({**SAMPLE, "sampling": {"typical_p": "NaN"}}, "typical_p must be <= 1.0"),
    ({**SAMPLE, "sampling": {"typical_p": "Infinity"}}, "typical_p must be <= 1.0"),
    ({"decoding": {"repetition_penalty": "NaN"}}, "repetition_penalty must be > 0.0"),
    ({"decoding": {"repetition_penalty": "Infinity"}}, "repetition_penalty must be > 0.0"),
    (
        {"decoding": {"length_penalty": {"start_index": 1, "decay_factor": "NaN"}}},
        "length_penalty must be >= 1.0 and <= 10.0",
    ),
    ({"response": {**TOKENS, "top_n_tokens": 10**9}}, "top_n_tokens (1000000000) must be <= 10"),
    ({"response": {"input_tokens": True, "top_n_tokens": 11}}, "top_n_tokens (11) must be <= 10"),
]


def bad_calls(server: Server) -> list[tuple[str, Callable[[], Any], grpc.StatusCode, str]]:
    """(name, call, expected code, expected message or regex) of every bad request."""
    calls: list[tuple[str, Callable[[], Any], grpc.StatusCode, str]] = []
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    for i, (params, message) in enumerate(BAD_PARAMS):
        request = batch_request(["Hello"], params)
        calls.append((f"generate {i}", lambda r=request: server.stub.Generate(r), invalid, message))
        calls.append(
            (
                f"stream {i}",
                lambda p=params: stream_text(server, "Hello", p),
                invalid,
                re.escape(message),
            )
        )
    for size in (100_000, 1_000_000):
        request = batch_request(["Hello"], {}, prefix_id="p" * size)
        message = (
            f"can't retrieve prompt prefix with id '{'p' * 256}…': "
            f'prefix id "{"p" * 256}…" not found'
        )
        call = functools.partial(server.stub.Generate, request)
        calls.append((f"prefix {size}", call, invalid, message))
    huge = "word " * (MAX_INPUT_BYTES // 5 + 1)
    size_message = (
        f"input text is {len(huge)} UTF-8 bytes, more than the {MAX_INPUT_BYTES} allowed per input"
    )
    call = functools.partial(
        server.stub.Generate, batch_request([huge], {"truncate_input_tokens": 10})
    )
    calls.append(("huge input", call, invalid, size_message))
    raw = server.channel.unary_unary("/fmaas.GenerationService/Generate")
    call = functools.partial(raw, b"\xff\xff\xff\xff", timeout=10)
    calls.append(("undecodable", call, invalid, "malformed request message: "))
    return calls


def test_bad_requests_fail_alone(server: Server) -> None:
    prompts = CHAT_PROMPTS[:4]
    solo = [generate_texts(server, [p], INNOCENT)[0] for p in prompts]
    calls = bad_calls(server)
    start = threading.Barrier(len(calls) + 2 * len(prompts))

    def innocent(i: int) -> str:
        start.wait()
        prompt = prompts[i % len(prompts)]
        if i % 2:
            return stream_text(server, prompt, INNOCENT)
        return generate_texts(server, [prompt], INNOCENT)[0]

    def hostile(i: int) -> tuple[grpc.StatusCode, str]:
        start.wait()
        return status_of(calls[i][1])

    with ThreadPoolExecutor(len(calls) + 2 * len(prompts)) as pool:
        innocents = [pool.submit(innocent, i) for i in range(2 * len(prompts))]
        hostiles = [pool.submit(hostile, i) for i in range(len(calls))]
        assert [f.result(timeout=120) for f in innocents] == solo + solo
        for (name, _, code, message), future in zip(calls, hostiles, strict=True):
            got_code, got_message = future.result(timeout=120)
            assert got_code == code, (name, got_message)
            if name.startswith("stream") or name == "undecodable":
                assert re.match(message, got_message), (name, got_message)
            else:
                assert got_message == message, name
    log = server.process.log_text()
    assert "Traceback" not in log
    warnings = [line for line in log.splitlines() if "undecodable request" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0]
    assert server.stub.ModelInfo(pb.ModelInfoRequest()).max_sequence_length == MAX_SEQ


def test_undecodable_bytes(server: Server) -> None:
    raw = server.channel.unary_unary("/fmaas.GenerationService/Tokenize")
    code, message = status_of(lambda: raw(b"\x0a\x05\xff\xfe", timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert message.startswith("malformed request message: ")
    stream = server.channel.unary_stream("/fmaas.GenerationService/GenerateStream")
    code, message = status_of(lambda: list(stream(b"\xff", timeout=10)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert message.startswith("malformed request message: ")


def tokenize_request(texts: list[str], **fields: Any) -> Any:
    return pb.BatchedTokenizeRequest(requests=[pb.TokenizeRequest(text=t) for t in texts], **fields)


def test_tokenize_size_limit_and_admission(server: Server) -> None:
    text = "word " * 700_000  # 3.5 MB
    code, message = status_of(
        lambda: server.stub.Tokenize(tokenize_request([text], return_offsets=True), timeout=30)
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert message == (
        f"input text is {len(text)} UTF-8 bytes, more than the {MAX_INPUT_BYTES} allowed per input"
    )
    code, message = status_of(
        lambda: server.stub.Tokenize(tokenize_request(["x"] * (MAX_CONCURRENT + 1)), timeout=30)
    )
    assert (code, message) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "Model is overloaded")
    # Truncation keeps the last N tokens, as TGIS.
    (result,) = server.stub.Tokenize(
        tokenize_request(["a b c d e f"], truncate_input_tokens=2, return_tokens=True)
    ).responses
    assert result.token_count == 2 and len(result.tokens) == 2


def test_large_tokenize_does_not_stall_model_info(server: Server) -> None:
    """12 texts of ~250 KB (3 MB, each under the cap): ModelInfo keeps answering meanwhile."""
    texts = [f"{i} " + "word " * ((MAX_INPUT_BYTES - 1000) // 5) for i in range(12)]
    request = tokenize_request(texts)
    info = pb.ModelInfoRequest()
    server.stub.ModelInfo(info)  # warm
    latencies: list[float] = []
    with ThreadPoolExecutor(1) as pool:
        t0 = time.monotonic()
        future = pool.submit(server.stub.Tokenize, request, timeout=120)
        while not future.done():
            start = time.monotonic()
            server.stub.ModelInfo(info, timeout=10)
            latencies.append(time.monotonic() - start)
            time.sleep(0.01)
        response = future.result()
        tokenize_s = time.monotonic() - t0
    assert len(response.responses) == 12
    assert all(r.token_count > 40_000 for r in response.responses)
    print(
        f"Tokenize of {sum(map(len, texts))} bytes took {tokenize_s:.2f} s; {len(latencies)} "
        f"ModelInfo calls meanwhile, max {max(latencies) * 1000:.0f} ms, "
        f"median {sorted(latencies)[len(latencies) // 2] * 1000:.0f} ms"
    )
    assert len(latencies) >= 3, f"Tokenize took only {tokenize_s:.2f} s"
    assert max(latencies) < 0.2


def test_response_size_bound(server: Server) -> None:
    params = {
        "stopping": {"max_new_tokens": 1},
        "response": {"input_tokens": True, "token_logprobs": True, "top_n_tokens": 10},
    }
    texts = [f"{i} " + " ".join(["word"] * 200) for i in range(8)]
    code, message = status_of(
        lambda: server.stub.Generate(batch_request(texts, params), timeout=60)
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert message.startswith(f"the response would exceed {MAX_RESPONSE_BYTES} bytes")
    (alone,) = server.stub.Generate(batch_request(texts[:1], params), timeout=60).responses
    assert len(alone.input_tokens) > 200
    offsets = tokenize_request(["word " * 12_000] * 3, return_offsets=True)  # 36k offsets
    code, message = status_of(lambda: server.stub.Tokenize(offsets, timeout=60))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert message.startswith(f"the response would exceed {MAX_RESPONSE_BYTES} bytes")


def test_second_server_on_used_ports_exits(server: Server) -> None:
    port = server.process.grpc_port
    second = ServerProcess(MODEL, ENV, grpc_port=port, start_timeout_s=30)
    t0 = time.monotonic()
    assert second.run_to_exit() != 0
    elapsed = time.monotonic() - t0
    log = second.log_text()
    print(f"second server on GRPC_PORT {port} exited in {elapsed:.1f} s")
    assert elapsed < 20
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and f"gRPC port {port} (GRPC_PORT) is already in use" in errors[0]
    assert "Traceback" not in log

    http_port = server.process.http_port
    second = ServerProcess(MODEL, ENV, http_port=http_port, start_timeout_s=30)
    assert second.run_to_exit(watch_health=False) != 0
    log = second.log_text()
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and f"HTTP port {http_port} (PORT) is already in use" in errors[0]
    assert "Traceback" not in log and "Event loop is closed" not in log
    assert server.stub.ModelInfo(pb.ModelInfoRequest()).max_sequence_length == MAX_SEQ


def test_sigterm_past_grace_cancels_streams_quietly(server: Server) -> None:
    params = {"stopping": {"max_new_tokens": 200, "min_new_tokens": 200}}
    request = json_format.ParseDict(
        {"request": {"text": "Once upon a time"}, "params": params}, pb.SingleGenerationRequest()
    )
    calls = [server.stub.GenerateStream(request, timeout=60) for _ in range(3)]
    for call in calls:
        next(call)
    server.process.send_signal(signal.SIGTERM)
    cancelled = 0
    for call in calls:
        try:
            list(call)
        except grpc.RpcError:
            cancelled += 1
    assert cancelled, "every stream finished before SIGTERM: nothing was cancelled"
    assert server.process.wait(timeout_s=20) == 0
    log = server.process.log_text()
    assert "Traceback" not in log and "CancelledError" not in log
    assert "shutdown complete" in log
