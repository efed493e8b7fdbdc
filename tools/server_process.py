"""The real server as a subprocess: `python -m server.main` on free loopback ports.

The one place that starts it: used by the server tests (tests/server/), the integration suite and
the benchmarks, which all talk to the server the way a client does (gRPC on `grpc_target`, HTTP
`/health` and `/metrics` on `http_url`; `/health` stays plaintext when gRPC uses TLS). The
server's stdout and stderr go to a log file. Importing this module is cheap (no torch, no gRPC).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

REPO = Path(__file__).resolve().parent.parent


class ServerStartError(RuntimeError):
    """The server exited, or did not answer /health with 200, before the deadline."""


def free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports on 127.0.0.1 that were free a moment ago: all `n` sockets are bound
    at once, so no two of them get the same port (as two calls in a row can)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    return free_ports(1)[0]


class ServerProcess:
    """One server subprocess. `start()` returns once `GET /health` answers 200; `stop()` sends
    SIGTERM and returns the exit code (killing the process after `stop_timeout_s`). Also a
    context manager. `run_to_exit()` is for a start that must fail: it returns the exit code of a
    server that stops by itself, its output in `log_text()`.

    `env` is added to the current environment (values override it; with `inherit_env=False` it
    replaces it) and the variables named in `unset` are removed from it; MODEL_NAME, GRPC_PORT
    and PORT are set from the arguments, and PYTHONPATH to the repository root. `python` defaults
    to the running interpreter. `grpc_port` / `http_port` default to free ports (give a used one
    to test a server that must refuse it).
    """

    def __init__(
        self,
        model: str | Path,
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        python: str | None = None,
        start_timeout_s: float = 180.0,
        unset: Sequence[str] = (),
        inherit_env: bool = True,
        grpc_port: int | None = None,
        http_port: int | None = None,
    ) -> None:
        self.model = str(model)
        free_grpc, free_http = free_ports(2)
        self.grpc_port = free_grpc if grpc_port is None else grpc_port
        self.http_port = free_http if http_port is None else http_port
        self.extra_env = dict(env or {})
        self.unset = tuple(unset)
        self.inherit_env = inherit_env
        self.log_path = log_path or Path(f"/tmp/specserve-server-{self.grpc_port}.log")
        self.python = python or sys.executable
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def _spawn(self) -> subprocess.Popen[bytes]:
        inherited = os.environ if self.inherit_env else {}
        env = {
            **{k: v for k, v in inherited.items() if k not in self.unset},
            **self.extra_env,
            "PYTHONPATH": str(REPO),
            "MODEL_NAME": self.model,
            "GRPC_PORT": str(self.grpc_port),
            "PORT": str(self.http_port),
        }
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [self.python, "-m", "server.main"],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return self.proc

    def start(self) -> ServerProcess:
        proc = self._spawn()
        deadline = time.monotonic() + self.start_timeout_s
        while self.health() != 200:
            if proc.poll() is not None:
                raise ServerStartError(f"server exited with {proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(f"server not healthy in time:\n{self.log_tail()}")
            time.sleep(0.2)
        return self

    def run_to_exit(self, watch_health: bool = True) -> int:
        """Start a server that is expected to refuse to start: wait for it to exit by itself and
        return its exit code (its output is in `log_text()`). Raises ServerStartError, after
        stopping it, if it answers /health with 200 (unless `watch_health` is False: when its
        HTTP port is another server's) or is still running after `start_timeout_s`."""
        proc = self._spawn()
        deadline = time.monotonic() + self.start_timeout_s
        while proc.poll() is None:
            if (watch_health and self.health() == 200) or time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(
                    f"server started instead of exiting by itself:\n{self.log_tail()}"
                )
            time.sleep(0.2)
        return proc.returncode

    def send_signal(self, sig: int) -> None:
        """Send `sig` (e.g. SIGTERM) to the running server."""
        assert self.proc is not None, "the server was not started"
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        """Wait for the server to exit and return its exit code (TimeoutExpired after
        `timeout_s`)."""
        assert self.proc is not None, "the server was not started"
        return self.proc.wait(timeout=timeout_s)

    def stop(self, stop_timeout_s: float = 30.0) -> int | None:
        """SIGTERM, then wait; returns the exit code (None if it was never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def health(self) -> int | None:
        """The status of `GET /health`, or None when nothing answers."""
        try:
            with urllib.request.urlopen(f"{self.http_url}/health", timeout=5) as response:
                return int(response.status)
        except urllib.error.HTTPError as e:
            return int(e.code)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return None

    def metrics_text(self) -> str:
        """The body of `GET /metrics`."""
        with urllib.request.urlopen(f"{self.http_url}/metrics", timeout=10) as response:
            return str(response.read().decode())

    def metric(self, sample: str, default: float | None = None) -> float:
        """The value of one sample, e.g. ``tgi_queue_size`` or
        ``tgi_request_failure_total{err="validation"}`` (labels exactly as exposed); `default`
        if absent (a labelled counter appears on first use), or KeyError without one."""
        match = re.search(rf"^{re.escape(sample)} (\S+)$", self.metrics_text(), re.MULTILINE)
        if match is None:
            if default is None:
                raise KeyError(sample)
            return default
        return float(match.group(1))

    def log_text(self) -> str:
        """The server's whole output so far (its stdout and stderr, in one file)."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_text()[-chars:]
