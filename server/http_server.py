"""HTTP on PORT (docs/tgis-compatibility.md, "HTTP"): `GET /health` and `GET /metrics`, stdlib only.

Served by a `ThreadingHTTPServer` on a daemon thread, so a slow health probe never blocks the
gRPC event loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST

from server.metrics import ServerMetrics

_UNHEALTHY = b'{"error":"unhealthy"}'


class HttpServer:
    """`/health`: 200 with an empty body when `health()` is True, else 503
    ``{"error":"unhealthy"}``. `/metrics`: the Prometheus text of `metrics`. Anything else:
    404. Constructing it binds the port (OSError if taken); `start()` serves; `stop()` closes
    it, started or not."""

    def __init__(
        self, host: str, port: int, health: Callable[[], bool], metrics: ServerMetrics
    ) -> None:
        handler = _make_handler(health, metrics)
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="http", daemon=True)
        self._started = False

    @property
    def port(self) -> int:
        """The bound port (useful when constructed with port 0)."""
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()
        self._started = True

    def stop(self) -> None:
        if self._started:  # shutdown() waits for serve_forever, forever if it never ran
            self._server.shutdown()
        self._server.server_close()


def _make_handler(
    health: Callable[[], bool], metrics: ServerMetrics
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/health":
                if health():
                    self._reply(200, b"", "text/plain")
                else:
                    self._reply(503, _UNHEALTHY, "application/json")
            elif path == "/metrics":
                self._reply(200, metrics.render(), CONTENT_TYPE_LATEST)
            else:
                self._reply(404, b"", "text/plain")

        def _reply(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler
