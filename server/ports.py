"""Binding the server's ports, with start-up errors that name the port and its variable."""

from __future__ import annotations

import errno
import socket

import grpc
from starlette.types import ASGIApp

from server.http_server import HttpLimits, HttpServer


class StartupError(RuntimeError):
    """Start-up cannot go on; the message is the one line logged before exiting 1."""


def port_in_use_error(what: str, port: int, variable: str, detail: str) -> StartupError:
    return StartupError(f"{what} port {port} ({variable}) is already in use: {detail}")


def check_port_free(port: int, what: str, variable: str, host: str = "0.0.0.0") -> None:
    """Raise StartupError when something listens on `port` (0: nothing to check). Binds a
    throwaway socket with SO_REUSEADDR, as the servers do: on Linux that fails only when the
    port has a listener, not for connections lingering in TIME_WAIT."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise port_in_use_error(what, port, variable, e.strerror or str(e)) from None


def add_grpc_port(
    server: grpc.aio.Server, port: int, credentials: grpc.ServerCredentials | None
) -> int:
    """Bind the gRPC port; StartupError naming GRPC_PORT when it cannot be bound (grpc returns
    0 or raises RuntimeError, depending on its version)."""
    address = f"0.0.0.0:{port}"
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError as e:
        raise port_in_use_error("gRPC", port, "GRPC_PORT", str(e)) from None
    if bound == 0:
        raise port_in_use_error("gRPC", port, "GRPC_PORT", "grpc could not bind it")
    return bound


def bind_http(port: int, app: ASGIApp, limits: HttpLimits) -> HttpServer:
    """The HTTP server of `app` bound to `port` (not serving yet); StartupError naming PORT."""
    try:
        return HttpServer("0.0.0.0", port, app, limits)
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            raise StartupError(f"HTTP port {port} (PORT) cannot be bound: {e}") from None
        raise port_in_use_error("HTTP", port, "PORT", e.strerror or str(e)) from None
