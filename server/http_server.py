"""HTTP on PORT: the ASGI application of `server.openai.app` (`/health`, `/metrics` and the
OpenAI-compatible API) served by uvicorn on the event loop the gRPC server runs on.

uvicorn answers a connection that stays idle after a response (`timeout_keep_alive`) but sets
no deadline on a request's header or body, and bounds requests (`limit_concurrency`) but not
open connections; `guarded_protocol` adds both. A connection that has not sent a whole request
head within `header_timeout_s` of its opening (or of its previous response), or a whole body
within `body_timeout_s` of its head, is closed; beyond `max_connections` open ones, a new
connection is closed at once. No connection holds a thread: only `/health` and `/metrics` run on
worker threads, from a bounded pool.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HttpLimits:
    """Deadlines for a request's head and body (seconds) and the most open connections."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 1024
    keep_alive_s: float = 5.0


def guarded_protocol(limits: HttpLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with `limits`' deadlines and connection bound."""

    class GuardedProtocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _refused = False

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            if len(self.server_state.connections) >= limits.max_connections:
                self._refused = True
                transport.close()
                return
            super().connection_made(transport)  # type: ignore[arg-type]
            self._arm(limits.header_timeout_s)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            waiting_head = self.conn.their_state is h11.IDLE
            super().handle_events()
            state = self.conn.their_state
            if waiting_head and state is h11.SEND_BODY:
                self._arm(limits.body_timeout_s)
            elif state is not h11.IDLE and state is not h11.SEND_BODY:
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm(limits.header_timeout_s)

        def _arm(self, delay: float) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(delay, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            """Close a connection still sending a request head or body."""
            self._deadline = None
            if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
                busy = self.cycle is not None and not self.cycle.response_complete
                if self.conn.their_state is h11.IDLE and busy:
                    return
                self.transport.close()

    return GuardedProtocol


class HttpServer:
    """`app` on `host`:`port`. Constructing it binds the port (OSError if taken); `start()`
    serves on the running loop; `stop(grace_s)` stops accepting, lets responses in progress
    finish for up to `grace_s` seconds, then cancels them; it may be called unstarted."""

    def __init__(
        self, host: str, port: int, app: ASGIApp, limits: HttpLimits | None = None
    ) -> None:
        limits = limits or HttpLimits()
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._socket.bind((host, port))
            self._socket.listen(2048)
        except OSError:
            self._socket.close()
            raise
        self._socket.setblocking(False)
        self._config = uvicorn.Config(
            app,
            http=guarded_protocol(limits),
            lifespan="off",
            access_log=False,
            log_config=None,
            server_header=False,
            timeout_keep_alive=int(max(1, limits.keep_alive_s)),
            ws="none",
        )
        self._server = uvicorn.Server(self._config)
        # A malformed request is answered 400 and needs no log line each (a flood would flood).
        logging.getLogger("uvicorn.error").setLevel(logging.ERROR)
        self._main: asyncio.Task[Any] | None = None

    @property
    def port(self) -> int:
        """The bound port (useful when constructed with port 0)."""
        return int(self._socket.getsockname()[1])

    async def start(self) -> None:
        self._config.load()
        self._server.lifespan = self._config.lifespan_class(self._config)
        await self._server.startup(sockets=[self._socket])
        self._main = asyncio.create_task(self._server.main_loop())

    async def stop(self, grace_s: float = 0.0) -> None:
        if self._main is None:
            self._socket.close()
            return
        self._config.timeout_graceful_shutdown = max(1, round(grace_s))
        self._server.should_exit = True
        await self._main
        self._main = None
        await self._server.shutdown(sockets=[self._socket])
