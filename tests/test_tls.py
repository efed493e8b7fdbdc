"""TLS, mTLS, the gRPC health service and reflection on the real server (`python -m server.main`).

Certificates are made per test module with the `openssl` CLI: a CA, a server certificate for
127.0.0.1/localhost, a client certificate from the same CA and one from a foreign CA. One server
runs with TLS (and FLASH_ATTENTION/PAGED_ATTENTION set as in the model cards), one with mTLS;
start-up errors are checked on processes that exit before loading a model.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool, json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from engine.paths import model_path
from server.config import ServerConfig
from server.pb import generation_pb2 as pb
from server.pb import generation_pb2_grpc
from server.tls import TLSConfigError, server_credentials

REPO = Path(__file__).resolve().parent.parent
MODEL = "tiny-llama-gqa-tied"
GENERATION_SERVICE = "fmaas.GenerationService"
HEALTH_SERVICE = "grpc.health.v1.Health"
STARTUP_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- certificates


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    foreign_ca: Path
    foreign_client_cert: Path
    foreign_client_key: Path

    def read(self, name: str) -> bytes:
        path: Path = getattr(self, name)
        return path.read_bytes()


def _openssl(*args: str | Path, cwd: Path) -> None:
    proc = subprocess.run(
        ["openssl", *map(str, args)], cwd=cwd, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, f"openssl {' '.join(map(str, args))}:\n{proc.stderr}"


def _make_ca(folder: Path, name: str) -> tuple[Path, Path]:
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", key, "-out", cert, "-days", "2", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=folder,
    )  # fmt: skip
    return cert, key


def _make_leaf(
    folder: Path, name: str, ca: tuple[Path, Path], extensions: list[str]
) -> tuple[Path, Path]:
    cert, key, csr, ext = (folder / f"{name}{s}" for s in (".pem", ".key", ".csr", ".ext"))
    ext.write_text("\n".join(extensions) + "\n")
    _openssl(
        "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", key, "-out", csr, "-subj", f"/CN={name}",
        cwd=folder,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", csr, "-CA", ca[0], "-CAkey", ca[1], "-CAcreateserial",
        "-out", cert, "-days", "2", "-extfile", ext,
        cwd=folder,
    )  # fmt: skip
    return cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    if shutil.which("openssl") is None:
        pytest.fail("the openssl CLI is needed to make test certificates")
    folder = tmp_path_factory.mktemp("pki")
    ca = _make_ca(folder, "specserve-test-ca")
    foreign_ca = _make_ca(folder, "foreign-ca")
    server = _make_leaf(
        folder,
        "server",
        ca,
        ["subjectAltName=DNS:localhost,IP:127.0.0.1", "extendedKeyUsage=serverAuth"],
    )
    client_ext = ["extendedKeyUsage=clientAuth"]
    client = _make_leaf(folder, "client", ca, client_ext)
    foreign_client = _make_leaf(folder, "foreign-client", foreign_ca, client_ext)
    return Pki(ca[0], *server, *client, foreign_ca[0], *foreign_client)


# --------------------------------------------------------------------------- servers


@dataclass
class Server:
    proc: subprocess.Popen[str]
    target: str
    log: Path


def _server_env(grpc_port: int, http_port: int, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "MODEL_NAME": MODEL,
        "GRPC_PORT": str(grpc_port),
        "PORT": str(http_port),
        "KV_CACHE_BLOCKS": "16",
        "MAX_SEQUENCE_LENGTH": "128",
        "MAX_NEW_TOKENS": "16",
        "SHUTDOWN_GRACE_SECONDS": "5",
        "OMP_NUM_THREADS": "1",
        **extra,
    }


def _start(log: Path, **extra: str) -> Iterator[Server]:
    if not (model_path(MODEL) / "config.json").is_file():
        pytest.fail(f"{model_path(MODEL)} is missing: run `make models` first")
    grpc_port, http_port = _free_port(), _free_port()
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "server.main"],
            cwd=REPO,
            env=_server_env(grpc_port, http_port, **extra),
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    health = f"http://127.0.0.1:{http_port}/health"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if urllib.request.urlopen(health, timeout=2).status == 200:
                break
        except (urllib.error.URLError, ConnectionError):
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"server not healthy in time:\n{log.read_text()}")
        time.sleep(0.3)
    try:
        yield Server(proc, f"127.0.0.1:{grpc_port}", log)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def tls_server(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _start(
        tmp_path_factory.mktemp("tls") / "server.log",
        TLS_CERT_PATH=str(pki.server_cert),
        TLS_KEY_PATH=str(pki.server_key),
        FLASH_ATTENTION="true",
        PAGED_ATTENTION="true",
    )


@pytest.fixture(scope="module")
def mtls_server(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _start(
        tmp_path_factory.mktemp("mtls") / "server.log",
        TLS_CERT_PATH=str(pki.server_cert),
        TLS_KEY_PATH=str(pki.server_key),
        TLS_CLIENT_CA_CERT_PATH=str(pki.ca),
    )


def _channel(
    server: Server, roots: bytes | None, key: bytes | None = None, cert: bytes | None = None
) -> grpc.Channel:
    if roots is None:
        return grpc.insecure_channel(server.target)
    credentials = grpc.ssl_channel_credentials(roots, key, cert)
    return grpc.secure_channel(server.target, credentials)


def _generate(channel: grpc.Channel) -> pb.GenerationResponse:
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    request = json_format.ParseDict(
        {"requests": [{"text": "Hello"}], "params": {"stopping": {"max_new_tokens": 3}}},
        pb.BatchedGenerationRequest(),
    )
    response: pb.BatchedGenerationResponse = stub.Generate(request, timeout=30)
    assert len(response.responses) == 1
    return response.responses[0]


def _assert_refused(channel: grpc.Channel) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _generate(channel)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


# --------------------------------------------------------------------------- TLS


def test_tls_client_that_trusts_the_ca_gets_in(tls_server: Server, pki: Pki) -> None:
    with _channel(tls_server, pki.read("ca")) as channel:
        assert _generate(channel).generated_token_count == 3
    assert "gRPC TLS enabled" in tls_server.log.read_text()


def test_tls_refuses_plaintext_and_untrusting_clients(tls_server: Server, pki: Pki) -> None:
    with _channel(tls_server, None) as channel:
        _assert_refused(channel)
    with _channel(tls_server, pki.read("foreign_ca")) as channel:
        _assert_refused(channel)


def test_flash_and_paged_attention_switches_are_logged(tls_server: Server) -> None:
    log = tls_server.log.read_text()
    assert "always paged; FLASH_ATTENTION=true, PAGED_ATTENTION=true" in log
    assert "FLASH_ATTENTION=true but flash-attn is not usable on device cpu" in log


def test_health_service_answers_serving(tls_server: Server, pki: Pki) -> None:
    with _channel(tls_server, pki.read("ca")) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", GENERATION_SERVICE):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_and_describes_the_services(tls_server: Server, pki: Pki) -> None:
    with _channel(tls_server, pki.read("ca")) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        replies = list(stub.ServerReflectionInfo(iter([request]), timeout=10))
        names = {s.name for s in replies[0].list_services_response.service}
        assert {GENERATION_SERVICE, HEALTH_SERVICE} <= names

        pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
        service = pool.FindServiceByName(GENERATION_SERVICE)
        methods = {m.name for m in service.methods}
        assert {"Generate", "GenerateStream", "Tokenize", "ModelInfo"} <= methods


# --------------------------------------------------------------------------- mTLS


def test_mtls_refuses_a_client_without_a_certificate(mtls_server: Server, pki: Pki) -> None:
    with _channel(mtls_server, pki.read("ca")) as channel:
        _assert_refused(channel)
    assert "client certificates required (mTLS)" in mtls_server.log.read_text()


def test_mtls_refuses_a_certificate_from_another_ca(mtls_server: Server, pki: Pki) -> None:
    key, cert = pki.read("foreign_client_key"), pki.read("foreign_client_cert")
    with _channel(mtls_server, pki.read("ca"), key, cert) as channel:
        _assert_refused(channel)


def test_mtls_lets_in_a_ca_signed_client(mtls_server: Server, pki: Pki) -> None:
    key, cert = pki.read("client_key"), pki.read("client_cert")
    with _channel(mtls_server, pki.read("ca"), key, cert) as channel:
        assert _generate(channel).generated_token_count == 3


# --------------------------------------------------------------------------- start-up errors


def _run_main(**extra: str) -> subprocess.CompletedProcess[str]:
    env = _server_env(_free_port(), _free_port(), **extra)
    return subprocess.run(
        [sys.executable, "-m", "server.main"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=STARTUP_TIMEOUT_S,
        check=False,
    )


def test_certificate_without_key_stops_startup(pki: Pki) -> None:
    proc = _run_main(TLS_CERT_PATH=str(pki.server_cert))
    assert proc.returncode != 0
    assert "tls: must provide both cert and key" in proc.stdout + proc.stderr


def test_missing_tls_file_stops_startup_naming_it(tmp_path: Path, pki: Pki) -> None:
    missing = tmp_path / "no-such-key.pem"
    proc = _run_main(TLS_CERT_PATH=str(pki.server_cert), TLS_KEY_PATH=str(missing))
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert str(missing) in output and "does not exist" in output
    assert "gRPC server started" not in output


def test_invalid_attention_switch_stops_startup_naming_it() -> None:
    proc = _run_main(PAGED_ATTENTION="sometimes")
    assert proc.returncode != 0
    assert "from PAGED_ATTENTION" in proc.stdout + proc.stderr


def test_tls_config_rules(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tls: must provide both cert and key"):
        ServerConfig.from_env_and_args([], {"TLS_KEY_PATH": str(pki.server_key)})
    with pytest.raises(ValueError, match="tls: cannot provide client ca cert without keypair"):
        ServerConfig.from_env_and_args([], {"TLS_CLIENT_CA_CERT_PATH": str(pki.ca)})
    assert server_credentials(ServerConfig()) is None
    flags = ["--tls-cert-path", str(pki.server_cert), "--tls-key-path", str(pki.server_key)]
    config = ServerConfig.from_env_and_args(flags, {})
    assert config.tls_enabled and server_credentials(config) is not None

    mismatched = ServerConfig(tls_cert_path=str(pki.server_cert), tls_key_path=str(pki.client_key))
    with pytest.raises(TLSConfigError, match="not a valid pair"):
        server_credentials(mismatched)
    not_pem = tmp_path / "ca.txt"
    not_pem.write_text("not a certificate\n")
    with pytest.raises(TLSConfigError, match=f"{not_pem}.*is not PEM"):
        server_credentials(
            ServerConfig(
                tls_cert_path=str(pki.server_cert),
                tls_key_path=str(pki.server_key),
                tls_client_ca_cert_path=str(not_pem),
            )
        )


@pytest.mark.parametrize(
    ("value", "expected"), [("true", True), ("1", True), ("off", False), ("False", False)]
)
def test_attention_switches_parse_booleans(value: str, expected: bool) -> None:
    config = ServerConfig.from_env_and_args([], {"FLASH_ATTENTION": value})
    assert config.flash_attention is expected
    config = ServerConfig.from_env_and_args(["--paged-attention", value], {})
    assert config.paged_attention is expected
    with pytest.raises(ValueError, match="flash_attention: invalid value 'yes please'"):
        ServerConfig.from_env_and_args([], {"FLASH_ATTENTION": "yes please"})


# --------------------------------------------------------------------------- shutdown (last)


def test_health_turns_not_serving_while_draining(tls_server: Server, pki: Pki) -> None:
    """Stops `tls_server`: keep this test last in the module."""
    with _channel(tls_server, pki.read("ca")) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=GENERATION_SERVICE), timeout=30)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        tls_server.proc.send_signal(signal.SIGTERM)
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()
    assert tls_server.proc.wait(timeout=30) == 0
