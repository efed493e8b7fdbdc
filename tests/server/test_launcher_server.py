"""The real server started the way a TGIS user starts TGIS: every launcher flag of
docs/tgis-compatibility.md "Configuration" on the command line (plausible values, the ignored
ones logged as warnings), the model given as a Hub id at a revision and found in a local Hugging
Face cache, mTLS, JSON log lines, and OTLP spans received by a collector in this test. The same
server refuses requests carrying fields its proto does not define (vllm-tgis-adapter's adapter_id,
guided decoding) with INVALID_ARGUMENT, and counts failed prompt-prefix loads. A start with a
missing model writes its error to the termination log.
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from engine.paths import model_path
from server.pb import generation_pb2 as pb
from server.pb import generation_pb2_grpc
from tests.reference import require_model
from tests.server.test_tls import _make_ca, _make_leaf
from tools.server_process import ServerProcess, ServerStartError

MODEL = "tiny-llama-gqa-tied"
HUB_ID = "acme/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
MAX_SEQ = 256


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector that keeps every span it receives."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, trace_pb2.Span]] = []  # (service.name, span)
        self.lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:
        with self.lock:
            for resource_spans in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append((attrs.get("service.name", ""), span))
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, names: set[str], timeout_s: float = 20) -> list[trace_pb2.Span]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                spans = [s for _, s in self.spans]
            if names <= {s.name for s in spans}:
                return spans
            time.sleep(0.1)
        raise AssertionError(f"spans {names} not received; got {[s.name for s in spans]}")


@dataclass
class Server:
    process: ServerProcess
    stub: generation_pb2_grpc.GenerationServiceStub
    channel: grpc.Channel
    collector: Collector
    flags: list[str] = field(default_factory=list)


def tgis_flags(process: ServerProcess, pki: dict[str, Path], otlp_port: int) -> list[str]:
    """Every TGIS launcher flag (IBM main's `Args`), the ignored ones included, except
    --quantize (its TGIS values other than gptq stop start-up; a float model is served here)."""
    flags = {
        "--model-name": HUB_ID,
        "--revision": "v1",
        "--deployment-framework": "tgis_native",
        "--dtype": "float32",
        "--dtype-str": "fp32",
        "--num-shard": "1",
        "--max-concurrent-requests": "16",
        "--max-sequence-length": str(MAX_SEQ),
        "--max-new-tokens": "64",
        "--max-batch-size": "4",
        "--max-prefill-padding": "0.2",
        "--batch-safety-margin": "20",
        "--max-waiting-tokens": "24",
        "--port": str(process.http_port),
        "--grpc-port": str(process.grpc_port),
        "--shard-uds-path": "/tmp/text-generation-server",
        "--master-addr": "localhost",
        "--master-port": "29500",
        "--json-output": None,
        "--tls-cert-path": str(pki["server_cert"]),
        "--tls-key-path": str(pki["server_key"]),
        "--tls-client-ca-cert-path": str(pki["ca"]),
        "--output-special-tokens": None,
        "--cuda-process-memory-fraction": "0.9",
        "--default-include-stop-seqs": "false",
        "--otlp-endpoint": f"http://127.0.0.1:{otlp_port}",
        "--otlp-service-name": "tgis-compat-test",
        "--max-batch-weight": "100000",
        "--max-prefill-weight": "50000",
    }
    return [p for flag, value in flags.items() for p in (flag, value) if p is not None]


def make_pki(folder: Path) -> dict[str, Path]:
    if shutil.which("openssl") is None:
        pytest.fail("the openssl CLI is needed to make test certificates")
    ca = _make_ca(folder, "launcher-test-ca")
    server_cert, server_key = _make_leaf(
        folder,
        "server",
        ca,
        ["subjectAltName=DNS:localhost,IP:127.0.0.1", "extendedKeyUsage=serverAuth"],
    )
    client_cert, client_key = _make_leaf(folder, "client", ca, ["extendedKeyUsage=clientAuth"])
    return {
        "ca": ca[0],
        "server_cert": server_cert,
        "server_key": server_key,
        "client_cert": client_cert,
        "client_key": client_key,
    }


def make_hf_cache(folder: Path) -> Path:
    """A Hugging Face cache holding the tiny model as HUB_ID at revision v1 (no `main`), laid
    out as huggingface_hub writes it: files in `blobs/`, relative symlinks in the snapshot."""
    repo = folder / f"models--{HUB_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, file in enumerate(sorted(require_model(model_path(MODEL)).iterdir())):
        blob = repo / "blobs" / f"{i:040x}"
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(Path("../../blobs") / blob.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "v1").write_text(COMMIT)
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("launcher")
    pki = make_pki(folder)
    cache = make_hf_cache(folder / "hub")
    collector = Collector()
    otlp = grpc.server(ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, otlp)
    otlp_port = otlp.add_insecure_port("127.0.0.1:0")
    otlp.start()
    env = {
        "HF_HUB_CACHE": str(cache),
        "KV_CACHE_BLOCKS": "64",
        "OMP_NUM_THREADS": "1",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    process = ServerProcess("no-such-model", env, folder / "server.log", start_timeout_s=120)
    flags = tgis_flags(process, pki, otlp_port)
    wrapper = folder / "python-with-tgis-flags"
    wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@" {shlex.join(flags)}\n')
    wrapper.chmod(0o755)
    process.python = str(wrapper)
    try:
        process.start()
    except ServerStartError as e:
        otlp.stop(None)
        pytest.fail(str(e))
    credentials = grpc.ssl_channel_credentials(
        pki["ca"].read_bytes(), pki["client_key"].read_bytes(), pki["client_cert"].read_bytes()
    )
    channel = grpc.secure_channel(process.grpc_target, credentials)
    try:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        yield Server(process, stub, channel, collector, flags)
    finally:
        channel.close()
        process.stop(stop_timeout_s=20)
        otlp.stop(None)


def log_records(server: Server) -> list[dict[str, Any]]:
    lines = [line for line in server.process.log_text().splitlines() if line.strip()]
    return [json.loads(line) for line in lines]  # every line is one JSON object


def test_every_tgis_flag_starts_the_server(server: Server) -> None:
    request = json_format.ParseDict(
        {"requests": [{"text": "Hello"}], "params": {"stopping": {"max_new_tokens": 4}}},
        pb.BatchedGenerationRequest(),
    )
    (response,) = server.stub.Generate(request, timeout=60).responses
    assert response.generated_token_count == 4
    info = server.stub.ModelInfo(pb.ModelInfoRequest(), timeout=10)
    assert (info.max_sequence_length, info.max_new_tokens) == (MAX_SEQ, 64)
    records = log_records(server)
    assert {"timestamp", "level", "logger", "message"} <= set(records[0])
    messages = [r["message"] for r in records]
    snapshot = f"models--acme--tiny-llama/snapshots/{COMMIT}"
    assert any(m.startswith(f"model {HUB_ID}: ") and m.endswith(snapshot) for m in messages)
    warned = {r["message"].split("=")[0] for r in records if r["level"] == "WARNING"}
    ignored = {
        "DEPLOYMENT_FRAMEWORK", "MAX_PREFILL_PADDING", "BATCH_SAFETY_MARGIN",
        "MAX_WAITING_TOKENS", "SHARD_UDS_PATH", "MAX_BATCH_WEIGHT", "MAX_PREFILL_WEIGHT",
    }  # fmt: skip
    assert ignored <= warned
    assert "gRPC server started on port" in " ".join(messages)
    assert any(m == "gRPC TLS enabled: client certificates required (mTLS)" for m in messages)


def test_spans_reach_the_otlp_collector(server: Server) -> None:
    request = json_format.ParseDict(
        {
            "requests": [{"text": "Hello there"}, {"text": "Once upon a time"}],
            "params": {"stopping": {"max_new_tokens": 6, "min_new_tokens": 6}},
        },
        pb.BatchedGenerationRequest(),
    )
    traceparent = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
    metadata = (("traceparent", traceparent), ("x-correlation-id", "corr-7"))
    server.stub.Generate(request, metadata=metadata, timeout=60)
    stream = json_format.ParseDict(
        {"request": {"text": "Hi"}, "params": {"stopping": {"max_new_tokens": 3}}},
        pb.SingleGenerationRequest(),
    )
    list(server.stub.GenerateStream(stream, timeout=60))
    names = {"fmaas.GenerationService/Generate", "fmaas.GenerationService/GenerateStream"}
    spans = server.collector.wait_for(names | {"sequence"})
    assert {service for service, _ in server.collector.spans} == {"tgis-compat-test"}
    (rpc,) = [s for s in spans if s.trace_id.hex() == TRACE_ID and s.name in names]
    assert rpc.parent_span_id.hex() == "00f067aa0ba902b7"
    assert rpc.kind == trace_pb2.Span.SPAN_KIND_SERVER
    rpc_attrs = {a.key: a.value for a in rpc.attributes}
    assert rpc_attrs["correlation_id"].string_value == "corr-7"
    assert rpc_attrs["request.inputs"].int_value == 2
    sequences = [s for s in spans if s.name == "sequence" and s.parent_span_id == rpc.span_id]
    assert len(sequences) == 2
    for seq in sequences:
        attrs = {a.key: a.value for a in seq.attributes}
        assert attrs["generated_tokens"].int_value == 6
        assert attrs["stop_reason"].string_value == "MAX_TOKENS"
        assert attrs["input_tokens"].int_value > 0
        queue, prefill = attrs["queue_time_s"].double_value, attrs["prefill_time_s"].double_value
        decode, total = attrs["decode_time_s"].double_value, attrs["total_time_s"].double_value
        assert queue >= 0 and prefill > 0 and decode > 0
        assert queue + prefill + decode <= total + 1e-6
        assert [e.name for e in seq.events] == ["scheduled", "first_token"]
        assert seq.start_time_unix_nano <= rpc.end_time_unix_nano
        assert rpc.start_time_unix_nano <= seq.end_time_unix_nano <= rpc.end_time_unix_nano


def test_http_api_spans_reach_the_otlp_collector(server: Server) -> None:
    """A request of the OpenAI-compatible API gets a span of its route, child of its
    traceparent header, with one sequence span per choice (the HTTP port stays plaintext)."""
    base = server.process.http_url
    with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as reply:
        (model,) = json.loads(reply.read())["data"]
    trace_id = "0af7651916cd43dd8448eb211c80319d"
    body = {"model": model["id"], "prompt": "Hello", "max_tokens": 3, "n": 2, "seed": 1}
    request = urllib.request.Request(
        f"{base}/v1/completions",
        data=json.dumps(body).encode(),
        headers={
            "Content-Type": "application/json",
            "traceparent": f"00-{trace_id}-b7ad6b7169203331-01",
        },
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert len(json.loads(reply.read())["choices"]) == 2
    spans = server.collector.wait_for({"POST /v1/completions"})
    (http,) = [s for s in spans if s.trace_id.hex() == trace_id and s.name.startswith("POST")]
    assert http.name == "POST /v1/completions" and http.parent_span_id.hex() == "b7ad6b7169203331"
    assert http.kind == trace_pb2.Span.SPAN_KIND_SERVER
    deadline = time.monotonic() + 10
    while True:
        children = [s for _, s in server.collector.spans if s.parent_span_id == http.span_id]
        if len(children) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert sorted(c.name for c in children) == ["sequence", "sequence"]


def invalid_argument(call: Any) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    return str(info.value.details())


def with_field(message_bytes: bytes, number: int, payload: bytes) -> bytes:
    """`message_bytes` plus a length-delimited field `number` holding `payload` (the wire form
    of a string or message field the receiver may not know)."""
    return message_bytes + bytes([number << 3 | 2, len(payload)]) + payload


def test_unknown_request_fields_fail(server: Server) -> None:
    failures = 'tgi_request_failure_total{err="validation"}'
    before = server.process.metric(failures, 0)
    generate = server.channel.unary_unary("/fmaas.GenerationService/Generate")
    stream = server.channel.unary_stream("/fmaas.GenerationService/GenerateStream")
    tokenize = server.channel.unary_unary("/fmaas.GenerationService/Tokenize")
    batch = pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="Hello")])
    raw = batch.SerializeToString()
    assert generate(raw, timeout=60)  # the same bytes without extra fields work
    message = invalid_argument(lambda: generate(with_field(raw, 4, b"my-lora"), timeout=10))
    assert message == (
        "unsupported request field 'adapter_id' (number 4 of fmaas.BatchedGenerationRequest): "
        "this server does not implement it"
    )
    guided = with_field(raw, 10, with_field(b"", 5, with_field(b"", 4, b'{"type":"object"}')))
    message = invalid_argument(lambda: generate(guided, timeout=10))
    assert message == (
        "unsupported request field 'json_schema' (number 4 of fmaas.DecodingParameters) in "
        "params.decoding: this server does not implement it"
    )
    single = pb.SingleGenerationRequest(request=pb.GenerationRequest(text="Hi"))
    regex = with_field(
        single.SerializeToString(), 10, with_field(b"", 5, with_field(b"", 5, b"[a-z]+"))
    )
    message = invalid_argument(lambda: list(stream(regex, timeout=10)))
    assert message.startswith("unsupported request field 'regex' (number 5 of fmaas.Decoding")
    future = pb.BatchedTokenizeRequest(requests=[pb.TokenizeRequest(text="Hi")])
    adapter = with_field(future.SerializeToString(), 7, b"my-lora")
    message = invalid_argument(lambda: tokenize(adapter, timeout=10))
    assert message.startswith("unsupported request field 'adapter_id' (number 7 of fmaas.Batch")
    newer = with_field(raw, 10, with_field(b"", 15, b"?"))
    message = invalid_argument(lambda: generate(newer, timeout=10))
    assert message.startswith("unsupported request field number 15 of fmaas.Parameters in params")
    assert server.process.metric(failures) == before + 4  # Tokenize failures are not counted


def test_prompt_load_failures_are_counted(server: Server) -> None:
    before = server.process.metric("tgi_prompt_load_failure_total", 0)
    request = pb.BatchedGenerationRequest(
        prefix_id="my-prompt", requests=[pb.GenerationRequest(text="Hello")]
    )
    message = invalid_argument(lambda: server.stub.Generate(request, timeout=10))
    assert (
        message
        == "can't retrieve prompt prefix with id 'my-prompt': prefix id \"my-prompt\" not found"
    )
    assert server.process.metric("tgi_prompt_load_failure_total") == before + 1
    assert server.process.metric("tgi_prompt_load_failure") == before + 1
    text = server.process.metrics_text()
    for name in (
        "tgi_queue_jump",
        "tgi_granular_batch_addition",
        "tgi_prefill_weight_limit_exceeded",
        "tgi_prefill_padding_limit_exceeded",
    ):
        assert name not in text


def test_missing_model_writes_the_termination_log(tmp_path: Path) -> None:
    termination_log = tmp_path / "termination-log"
    env = {
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "REVISION": "v9",
        "JSON_OUTPUT": "true",
        "TERMINATION_LOG_PATH": str(termination_log),
    }
    process = ServerProcess("meta-llama/Llama-2-13b-chat-hf", env, tmp_path / "server.log")
    assert process.run_to_exit() == 1
    message = termination_log.read_text()
    assert message.startswith("model 'meta-llama/Llama-2-13b-chat-hf' not found: ")
    assert message.endswith(
        f"no snapshot of meta-llama/Llama-2-13b-chat-hf at revision v9 in the HF cache "
        f"{tmp_path / 'hub'}\n"
    )
    (error,) = [
        r for r in map(json.loads, process.log_text().splitlines()) if r["level"] == "ERROR"
    ]
    assert error["message"] == message.rstrip("\n")
