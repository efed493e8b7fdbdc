"""Server-side guards against one request harming another (docs/deployment.md, "Request
limits") that need no server process: the preemption counter, the
response-size bound, the rate-limited warning and the port checks (the real server runs them
in tests/server/test_isolation.py)."""

from __future__ import annotations

import logging
import socket

import pytest

from server.decode_guard import _RateLimitedWarning
from server.errors import ResponseTooLarge, SizeBound
from server.pb import generation_pb2 as pb
from server.ports import StartupError, check_port_free


def test_size_bound() -> None:
    response = pb.BatchedGenerationResponse()
    bound = SizeBound(1000)
    for _ in range(3):
        response.responses.append(pb.GenerationResponse(text="x" * 300))
        bound.add(response.responses[-1])
    assert bound.size == response.ByteSize()
    response.responses.append(pb.GenerationResponse(text="x" * 300))
    with pytest.raises(ResponseTooLarge, match="would exceed 1000 bytes"):
        bound.add(response.responses[-1])
    assert bound.check(pb.GenerationResponse(text="x" * 990)).text
    with pytest.raises(ResponseTooLarge):
        bound.check(pb.GenerationResponse(text="x" * 1000))


def test_rate_limited_warning(caplog: pytest.LogCaptureFixture) -> None:
    warning = _RateLimitedWarning(interval_s=3600)
    with caplog.at_level(logging.WARNING, logger="server.grpc_server"):
        for i in range(5):
            warning.warn("bad %d", i)
    assert [r.getMessage() for r in caplog.records] == ["bad 0"]
    warning._last -= 3600
    with caplog.at_level(logging.WARNING, logger="server.grpc_server"):
        warning.warn("bad %d", 5)
    assert caplog.records[-1].getMessage() == "bad 5 (4 more in the previous 3600 s)"


def test_check_port_free_names_the_port_and_variable() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(StartupError) as info:
            check_port_free(port, "gRPC", "GRPC_PORT")
    assert str(info.value).startswith(f"gRPC port {port} (GRPC_PORT) is already in use")
    check_port_free(port, "gRPC", "GRPC_PORT")  # free again
    check_port_free(0, "HTTP", "PORT")  # 0: any free port, nothing to check
