"""TGIS launcher parity without a server process (TGIS's launcher/src/main.rs `Args`): every
launcher flag parses (the ignored ones with a warning), dtype names, Hub ids resolved from a
local Hugging Face cache, JSON log lines, the termination log, unknown request fields, and the
request spans (on the SDK's in-memory exporter)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import server.main
from engine.paths import ModelNotFoundError, find_model, hf_hub_cache
from server.cli import IGNORED_LAUNCHER_FLAGS, parse_launcher
from server.config import ServerConfig
from server.dtypes import canonical_dtype
from server.logs import JsonFormatter, setup_logging
from server.messages import ValidationError
from server.model_files import model_path, speculator_model_path, with_resolved_models
from server.pb import generation_pb2 as pb
from server.proto_fields import check_known_fields
from server.tracing import RequestTracer, SequenceRecord, rpc_span

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "89abcdef0123456789abcdef0123456789abcdef"

# Every flag of TGIS's launcher (IBM main, launcher/src/main.rs `Args`), with a plausible value.
TGIS_FLAGS: list[tuple[str, str | None]] = [
    ("--model-name", "acme/tiny"),
    ("--revision", "v1"),
    ("--deployment-framework", "tgis_native"),
    ("--dtype", "float32"),
    ("--dtype-str", "float32"),
    ("--quantize", "gptq"),
    ("--num-shard", "2"),
    ("--max-concurrent-requests", "64"),
    ("--max-sequence-length", "256"),
    ("--max-new-tokens", "64"),
    ("--max-batch-size", "4"),
    ("--max-prefill-padding", "0.2"),
    ("--batch-safety-margin", "20"),
    ("--max-waiting-tokens", "24"),
    ("--port", "3001"),
    ("--grpc-port", "8034"),
    ("--shard-uds-path", "/tmp/text-generation-server"),
    ("--master-addr", "rank0.local"),
    ("--master-port", "29511"),
    ("--json-output", None),
    ("--tls-cert-path", "/certs/server.pem"),
    ("--tls-key-path", "/certs/server.key"),
    ("--tls-client-ca-cert-path", "/certs/ca.pem"),
    ("--output-special-tokens", None),
    ("--cuda-process-memory-fraction", "0.8"),
    ("--default-include-stop-seqs", "false"),
    ("--otlp-endpoint", "http://otel-collector:4317"),
    ("--otlp-service-name", "tgis-test"),
]
HONOURED = {
    "model_name": "acme/tiny",
    "revision": "v1",
    "dtype": "float32",
    "max_concurrent_requests": 64,
    "max_sequence_length": 256,
    "max_new_tokens": 64,
    "max_batch_size": 4,
    "port": 3001,
    "grpc_port": 8034,
    "json_output": True,
    "tls_cert_path": "/certs/server.pem",
    "tls_key_path": "/certs/server.key",
    "tls_client_ca_cert_path": "/certs/ca.pem",
    "output_special_tokens": True,
    "cuda_process_memory_fraction": 0.8,
    "default_include_stop_seqs": False,
    "otlp_endpoint": "http://otel-collector:4317",
    "otlp_service_name": "tgis-test",
    "num_shard": 2,
    "master_addr": "rank0.local",
    "master_port": 29511,
    "quantize": "gptq",
}


def argv_of(flags: list[tuple[str, str | None]]) -> list[str]:
    return [part for flag, value in flags for part in (flag, value) if part is not None]


def env_of(flags: list[tuple[str, str | None]]) -> dict[str, str]:
    return {flag[2:].replace("-", "_").upper(): value or "true" for flag, value in flags}


@pytest.mark.parametrize("how", ["flags", "env"])
def test_every_tgis_launcher_flag_is_accepted(how: str) -> None:
    flags = [*TGIS_FLAGS, ("--max-batch-weight", "100000"), ("--max-prefill-weight", "50000")]
    if how == "flags":
        launch = parse_launcher(argv_of(flags), {"NUM_GPUS": "4"})
    else:
        launch = parse_launcher([], {**env_of(flags), "NUM_GPUS": "2"})
    config = launch.config
    for name, value in HONOURED.items():
        assert getattr(config, name) == value, name
    ignored = sorted(w.split("=")[0] for w in launch.warnings)
    expected = [flag[2:].replace("-", "_").upper() for flag in IGNORED_LAUNCHER_FLAGS]
    assert ignored == sorted(expected)
    framework = next(w for w in launch.warnings if w.startswith("DEPLOYMENT_FRAMEWORK"))
    assert framework == (
        "DEPLOYMENT_FRAMEWORK=tgis_native (--deployment-framework) is ignored: the engine is "
        "specserve's own (paged attention, continuous batching)"
    )


def test_no_ignored_flag_no_warning() -> None:
    assert parse_launcher([], {"MAX_BATCH_WEIGHT": " ", "NUM_SHARD": ""}).warnings == ()


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("float16", "float16"),
        ("half", "float16"),
        ("fp16", "float16"),
        ("torch.float16", "float16"),
        ("bfloat16", "bfloat16"),
        ("BF16", "bfloat16"),
        ("float32", "float32"),
        ("float", "float32"),
        ("fp32", "float32"),
    ],
)
def test_torch_dtype_names(name: str, dtype: str) -> None:
    assert canonical_dtype(name) == dtype
    assert ServerConfig.from_env_and_args([], {"DTYPE_STR": name}).dtype == dtype
    assert ServerConfig.from_env_and_args(["--dtype-str", name], {}).dtype == dtype
    assert ServerConfig(dtype=name).dtype == dtype


def test_dtype_int8_unknown_and_conflicts() -> None:
    launch = parse_launcher([], {"DTYPE_STR": "int8"})
    assert launch.config.dtype is None
    assert launch.warnings == (
        "DTYPE_STR=int8 is ignored: 8-bit (bitsandbytes) weights are not supported; "
        "weights load in the default dtype",
    )
    with pytest.raises(ValueError, match="dtype: invalid value 'float64' from DTYPE_STR"):
        parse_launcher([], {"DTYPE_STR": "float64"})
    assert parse_launcher([], {"DTYPE": "half", "DTYPE_STR": "fp16"}).config.dtype == "float16"
    with pytest.raises(ValueError, match="dtype: conflicting values"):
        parse_launcher([], {"DTYPE": "half", "DTYPE_STR": "bf16"})


def test_unknown_flag_is_a_configuration_error() -> None:
    with pytest.raises(ValueError, match="unrecognized arguments: --no-such-flag"):
        parse_launcher(["--no-such-flag"], {})


# --------------------------------------------------------------------------- HF cache


def make_snapshot(cache: Path, repo: str, commit: str, refs: tuple[str, ...]) -> Path:
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo_dir / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo_dir / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hub"
    for name in ("HF_HUB_CACHE", "TRANSFORMERS_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path / "specserve"))
    monkeypatch.chdir(tmp_path)
    return cache


def test_hub_ids_resolve_from_the_local_cache(hf_cache: Path) -> None:
    main = make_snapshot(hf_cache, "meta-llama/Llama-2-13b-chat-hf", COMMIT, ("main",))
    v1 = make_snapshot(hf_cache, "meta-llama/Llama-2-13b-chat-hf", OTHER_COMMIT, ("v1",))
    single = make_snapshot(hf_cache, "gpt2", COMMIT, ("main",))
    assert find_model("meta-llama/Llama-2-13b-chat-hf") == main
    assert find_model("meta-llama/Llama-2-13b-chat-hf", "v1") == v1
    assert find_model("meta-llama/Llama-2-13b-chat-hf", OTHER_COMMIT) == v1
    assert find_model("gpt2") == single
    config = ServerConfig.from_env_and_args(
        ["--model-name", "meta-llama/Llama-2-13b-chat-hf", "--revision", "v1"], {}
    )
    assert model_path(config) == v1
    spec = make_snapshot(hf_cache, "ibm-fms/llama-13b-accelerator", COMMIT, ("main",))
    env = {"SPECULATOR_NAME": "ibm-fms/llama-13b-accelerator", "MODEL_NAME": "gpt2"}
    resolved = with_resolved_models(ServerConfig.from_env_and_args([], env))
    assert (resolved.model_name, resolved.speculator_path) == (str(single), str(spec))


def test_missing_model_names_what_was_looked_for(hf_cache: Path, tmp_path: Path) -> None:
    make_snapshot(hf_cache, "meta-llama/Llama-2-13b-chat-hf", COMMIT, ("main",))
    with pytest.raises(ModelNotFoundError) as info:
        find_model("meta-llama/Llama-2-13b-chat-hf", "v2")
    assert str(info.value) == (
        "model 'meta-llama/Llama-2-13b-chat-hf' not found: no file or folder "
        f"{tmp_path}/meta-llama/Llama-2-13b-chat-hf; no snapshot of "
        f"meta-llama/Llama-2-13b-chat-hf at revision v2 in the HF cache {hf_cache}"
    )
    with pytest.raises(ModelNotFoundError, match=r"no prepared model .*specserve/models/gpt2; "):
        find_model("gpt2")
    with pytest.raises(ModelNotFoundError, match=r"^model '/no/such/folder' not found: no file "):
        find_model("/no/such/folder")
    (hf_cache / "models--acme--empty" / "refs").mkdir(parents=True)
    (hf_cache / "models--acme--empty" / "snapshots" / COMMIT).mkdir(parents=True)
    (hf_cache / "models--acme--empty" / "refs" / "main").write_text(COMMIT)
    with pytest.raises(ModelNotFoundError, match=r"snapshots/0123.* \(acme/empty at main\) has no"):
        find_model("acme/empty")
    with pytest.raises(ModelNotFoundError, match="speculator 'acme/spec' not found"):
        speculator_model_path(ServerConfig.from_env_and_args([], {"SPECULATOR_NAME": "acme/spec"}))


def test_hf_cache_folder_order(tmp_path: Path) -> None:
    assert hf_hub_cache({"HF_HUB_CACHE": "/a", "HF_HOME": "/h"}) == Path("/a")
    assert hf_hub_cache({"TRANSFORMERS_CACHE": "/t", "HF_HOME": "/h"}) == Path("/t")
    assert hf_hub_cache({"HF_HOME": "/h"}) == Path("/h/hub")
    assert hf_hub_cache({}) == Path.home() / ".cache" / "huggingface" / "hub"
    assert hf_hub_cache({"HF_HUB_CACHE": "/a", "TRANSFORMERS_CACHE": "/a"}) == Path("/a")
    with pytest.raises(ValueError, match="TRANSFORMERS_CACHE and HF_HUB_CACHE env vars can't"):
        hf_hub_cache({"HF_HUB_CACHE": "/a", "TRANSFORMERS_CACHE": "/b"})


# --------------------------------------------------------------------------- logs


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level, hook = root.handlers[:], root.level, threading.excepthook
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    threading.excepthook = hook
    logging.captureWarnings(False)


def test_json_log_lines(capsys: pytest.CaptureFixture[str], restore_logging: None) -> None:
    setup_logging("info", json_output=True)
    log = logging.getLogger("specserve.test")
    log.info("hello %s", "world")
    try:
        raise RuntimeError("boom\nsecond line")
    except RuntimeError:
        log.exception("it failed")
    thread = threading.Thread(target=lambda: 1 / 0, name="worker")
    thread.start()
    thread.join()
    lines = capsys.readouterr().out.splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["message"] for r in records] == [
        "hello world",
        "it failed",
        "uncaught exception in thread worker",
    ]
    first = records[0]
    assert set(first) == {"timestamp", "level", "logger", "message"}
    assert (first["level"], first["logger"]) == ("INFO", "specserve.test")
    assert first["timestamp"].endswith("Z") and first["timestamp"][10] == "T"
    assert records[1]["exception"].endswith("RuntimeError: boom\nsecond line")
    assert "ZeroDivisionError" in records[2]["exception"]


def test_json_formatter_is_one_line() -> None:
    record = logging.LogRecord("x", logging.WARNING, __file__, 1, "a\nb \u00e9", None, None)
    line = JsonFormatter().format(record)
    assert "\n" not in line and json.loads(line)["message"] == "a\nb \u00e9"


# --------------------------------------------------------------------------- termination log


@pytest.fixture
def quiet_main(monkeypatch: pytest.MonkeyPatch) -> None:
    """`server.main.main` without its process-wide logging set-up."""
    monkeypatch.setattr(server.main, "setup_logging", lambda level, json_output: None)


def test_termination_log_of_an_invalid_configuration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quiet_main: None
) -> None:
    path = tmp_path / "termination-log"
    monkeypatch.setenv("TERMINATION_LOG_PATH", str(path))
    assert server.main.main(["--no-such-flag"]) == 2
    assert path.read_text() == "invalid configuration: unrecognized arguments: --no-such-flag\n"
    monkeypatch.setenv("MAX_BATCH_SIZE", "0")
    assert server.main.main([]) == 2
    assert path.read_text() == "invalid configuration: max_batch_size must be >= 1, got 0\n"


def test_termination_log_of_a_missing_model(
    hf_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quiet_main: None
) -> None:
    path = tmp_path / "termination-log"
    monkeypatch.setenv("TERMINATION_LOG_PATH", str(path))
    assert server.main.main(["--model-name", "acme/missing", "--revision", "v3"]) == 1
    assert path.read_text().startswith("model 'acme/missing' not found: ")
    assert f"no snapshot of acme/missing at revision v3 in the HF cache {hf_cache}\n" in (
        path.read_text()
    )
    # The default path is written only where it exists (the kubelet mounts it).
    default = tmp_path / "dev-termination-log"
    monkeypatch.delenv("TERMINATION_LOG_PATH")
    monkeypatch.setattr("server.cli.DEFAULT_TERMINATION_LOG", str(default))
    assert server.main.main(["--model-name", "acme/missing"]) == 1
    assert not default.exists()
    default.write_text("")
    assert server.main.main(["--model-name", "acme/missing"]) == 1
    assert default.read_text().startswith("model 'acme/missing' not found")


# --------------------------------------------------------------------------- unknown fields


def with_field(message_bytes: bytes, number: int, payload: bytes) -> bytes:
    """`message_bytes` plus a length-delimited field `number` holding `payload`."""
    return message_bytes + bytes([number << 3 | 2, len(payload)]) + payload


def test_unknown_request_fields_are_named() -> None:
    base = pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="Hi")])
    raw = base.SerializeToString()
    cases = {
        with_field(raw, 4, b"my-lora"): "unsupported request field 'adapter_id' (number 4 of "
        "fmaas.BatchedGenerationRequest): this server does not implement it",
        with_field(raw, 10, with_field(b"", 5, with_field(b"", 5, b"a+"))): "unsupported "
        "request field 'regex' (number 5 of fmaas.DecodingParameters) in params.decoding: this "
        "server does not implement it",
        with_field(raw, 10, with_field(b"", 5, with_field(b"", 4, b"{}"))): "unsupported "
        "request field 'json_schema' (number 4 of fmaas.DecodingParameters) in params.decoding",
        raw + with_field(b"", 3, with_field(b"\x12\x02Yo", 9, b"x")): "unsupported request field "
        "number 9 of fmaas.GenerationRequest in requests[1]",
    }
    for data, message in cases.items():
        request = pb.BatchedGenerationRequest.FromString(data)
        with pytest.raises(ValidationError) as info:
            check_known_fields(request)
        assert info.value.message.startswith(message)
    check_known_fields(base)
    tokenize = pb.BatchedTokenizeRequest.FromString(with_field(b"", 7, b"lora"))
    with pytest.raises(ValidationError, match=r"'adapter_id' \(number 7 of fmaas.BatchedTok"):
        check_known_fields(tokenize)


# --------------------------------------------------------------------------- spans


def test_request_spans_in_memory() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = RequestTracer(provider.get_tracer("test"))
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    metadata = [("traceparent", f"00-{trace_id}-00f067aa0ba902b7-01"), ("x-correlation-id", "c1")]
    with tracer.rpc("Generate", metadata) as span:
        record = SequenceRecord(
            index=1,
            input_tokens=7,
            generated_tokens=5,
            max_new_tokens=20,
            stop_reason="MAX_TOKENS",
            decoding_method="greedy",
            seed=0,
            arrival=100.0,
            started=100.5,
            first_token=101.0,
            end=103.0,
        )
        tracer.sequence(span, record)
    with pytest.raises(ValidationError), tracer.rpc("Tokenize", None):
        raise ValidationError("nope")
    sequence, rpc, failed = exporter.get_finished_spans()
    assert rpc.name == "fmaas.GenerationService/Generate"
    assert rpc.kind == trace.SpanKind.SERVER
    assert format(rpc.context.trace_id, "032x") == trace_id
    assert rpc.parent is not None and format(rpc.parent.span_id, "016x") == "00f067aa0ba902b7"
    assert rpc.attributes is not None and rpc.attributes["correlation_id"] == "c1"
    assert sequence.parent is not None and sequence.parent.span_id == rpc.context.span_id
    attributes = dict(sequence.attributes or {})
    assert attributes == pytest.approx(
        {
            "sequence.index": 1,
            "input_tokens": 7,
            "generated_tokens": 5,
            "max_new_tokens": 20,
            "stop_reason": "MAX_TOKENS",
            "decoding_method": "greedy",
            "seed": 0,
            "total_time_s": 3.0,
            "queue_time_s": 0.5,
            "inference_time_s": 2.5,
            "time_per_token_s": 0.5,
            "prefill_time_s": 0.5,
            "decode_time_s": 2.0,
        }
    )
    assert sequence.start_time is not None and sequence.end_time is not None
    assert sequence.end_time - sequence.start_time == pytest.approx(3e9, abs=1e3)
    assert [e.name for e in sequence.events] == ["scheduled", "first_token"]
    assert sequence.events[1].timestamp - sequence.start_time == pytest.approx(1e9, abs=1e3)
    assert failed.status.status_code == trace.StatusCode.ERROR
    assert [e.name for e in failed.events] == ["exception"]
    with rpc_span(None, "Generate", None) as span:
        assert span is trace.INVALID_SPAN and not span.is_recording()


def test_tracing_sdk_is_not_imported_without_an_endpoint() -> None:
    code = "import sys, server.tracing; print('opentelemetry.sdk' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "False", result.stderr
