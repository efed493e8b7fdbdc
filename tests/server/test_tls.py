"""TLS, mTLS, the gRPC health service and reflection on the real server (`python -m server.main`).

Certificates are made per test module with the `openssl` CLI: a CA, a server certificate for
127.0.0.1/localhost, a client certificate from the same CA and one from a foreign CA. One server
runs with TLS (and FLASH_ATTENTION/PAGED_ATTENTION set as in the model cards), one with mTLS;
start-up errors are checked on processes that exit before loading a model.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
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
from tests.reference import require_model
from tools.server_process import ServerProcess, ServerStartError

MODEL = "tiny-llama-gqa-tied"
GENERATION_SERVICE = "fmaas.GenerationService"
HEALTH_SERVICE = "grpc.health.v1.Health"
STARTUP_TIMEOUT_S = 120.0


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


SERVER_ENV = {
    "KV_CACHE_BLOCKS": "16",
    "MAX_SEQUENCE_LENGTH": "128",
    "MAX_NEW_TOKENS": "16",
    "SHUTDOWN_GRACE_SECONDS": "5",
    "OMP_NUM_THREADS": "1",
}


def _server(log: Path, **extra: str) -> ServerProcess:
    return ServerProcess(MODEL, {**SERVER_ENV, **extra}, log, start_timeout_s=STARTUP_TIMEOUT_S)


def _start(log: Path, **extra: str) -> Iterator[ServerProcess]:
    require_model(model_path(MODEL))
    server = _server(log, **extra)
    try:
        server.start()
    except ServerStartError as e:
        pytest.fail(str(e))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tls_server(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from _start(
        tmp_path_factory.mktemp("tls") / "server.log",
        TLS_CERT_PATH=str(pki.server_cert),
        TLS_KEY_PATH=str(pki.server_key),
        FLASH_ATTENTION="true",
        PAGED_ATTENTION="true",
    )


@pytest.fixture(scope="module")
def mtls_server(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from _start(
        tmp_path_factory.mktemp("mtls") / "server.log",
        TLS_CERT_PATH=str(pki.server_cert),
        TLS_KEY_PATH=str(pki.server_key),
        TLS_CLIENT_CA_CERT_PATH=str(pki.ca),
    )


def _channel(
    server: ServerProcess,
    roots: bytes | None,
    key: bytes | None = None,
    cert: bytes | None = None,
) -> grpc.Channel:
    if roots is None:
        return grpc.insecure_channel(server.grpc_target)
    credentials = grpc.ssl_channel_credentials(roots, key, cert)
    return grpc.secure_channel(server.grpc_target, credentials)


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


def test_tls_client_that_trusts_the_ca_gets_in(tls_server: ServerProcess, pki: Pki) -> None:
    with _channel(tls_server, pki.read("ca")) as channel:
        assert _generate(channel).generated_token_count == 3
    assert "gRPC TLS enabled" in tls_server.log_text()


def test_tls_refuses_plaintext_and_untrusting_clients(tls_server: ServerProcess, pki: Pki) -> None:
    with _channel(tls_server, None) as channel:
        _assert_refused(channel)
    with _channel(tls_server, pki.read("foreign_ca")) as channel:
        _assert_refused(channel)


def test_flash_and_paged_attention_switches_are_logged(tls_server: ServerProcess) -> None:
    log = tls_server.log_text()
    assert "always paged; FLASH_ATTENTION=true, PAGED_ATTENTION=true" in log
    assert "FLASH_ATTENTION=true but flash-attn is not usable on device cpu" in log


def test_health_service_answers_serving(tls_server: ServerProcess, pki: Pki) -> None:
    with _channel(tls_server, pki.read("ca")) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", GENERATION_SERVICE):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_and_describes_the_services(tls_server: ServerProcess, pki: Pki) -> None:
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


def test_mtls_refuses_a_client_without_a_certificate(mtls_server: ServerProcess, pki: Pki) -> None:
    with _channel(mtls_server, pki.read("ca")) as channel:
        _assert_refused(channel)
    assert "client certificates required (mTLS)" in mtls_server.log_text()


def test_mtls_refuses_a_certificate_from_another_ca(mtls_server: ServerProcess, pki: Pki) -> None:
    key, cert = pki.read("foreign_client_key"), pki.read("foreign_client_cert")
    with _channel(mtls_server, pki.read("ca"), key, cert) as channel:
        _assert_refused(channel)


def test_mtls_lets_in_a_ca_signed_client(mtls_server: ServerProcess, pki: Pki) -> None:
    key, cert = pki.read("client_key"), pki.read("client_cert")
    with _channel(mtls_server, pki.read("ca"), key, cert) as channel:
        assert _generate(channel).generated_token_count == 3


# --------------------------------------------------------------------------- start-up errors


def _run_main(tmp_path: Path, **extra: str) -> tuple[int, str]:
    """Exit code and output of a server that must stop before loading a model."""
    server = _server(tmp_path / "refused.log", **extra)
    return server.run_to_exit(), server.log_text()


def test_certificate_without_key_stops_startup(tmp_path: Path, pki: Pki) -> None:
    returncode, output = _run_main(tmp_path, TLS_CERT_PATH=str(pki.server_cert))
    assert returncode != 0
    assert "tls: must provide both cert and key" in output


def test_missing_tls_file_stops_startup_naming_it(tmp_path: Path, pki: Pki) -> None:
    missing = tmp_path / "no-such-key.pem"
    returncode, output = _run_main(
        tmp_path, TLS_CERT_PATH=str(pki.server_cert), TLS_KEY_PATH=str(missing)
    )
    assert returncode != 0
    assert str(missing) in output and "does not exist" in output
    assert "gRPC server started" not in output


def test_invalid_attention_switch_stops_startup_naming_it(tmp_path: Path) -> None:
    returncode, output = _run_main(tmp_path, PAGED_ATTENTION="sometimes")
    assert returncode != 0
    assert "from PAGED_ATTENTION" in output


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


# --------------------------------------------------------------------------- shutdown (last)


def test_health_turns_not_serving_while_draining(tls_server: ServerProcess, pki: Pki) -> None:
    """Stops `tls_server`: keep this test last in the module."""
    with _channel(tls_server, pki.read("ca")) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=GENERATION_SERVICE), timeout=30)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        tls_server.send_signal(signal.SIGTERM)
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()
    assert tls_server.wait(timeout_s=30) == 0
