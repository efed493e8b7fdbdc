"""The real server as a subprocess: `python -m server.main` on free loopback ports.

Used by the tests, the integration suite and the serving benchmark, which all talk to the server
the way a client does (gRPC on `grpc_target`, HTTP `/health` and `/metrics` on `http_url`). The
server's stdout and stderr go to a log file. Importing this module is cheap (no torch, no gRPC).
"""

from __future__ import annotations

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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """One server subprocess. `start()` returns once `GET /health` answers 200; `stop()` sends
    SIGTERM and returns the exit code (killing the process after `stop_timeout_s`). Also a
    context manager.

    `env` is added to the current environment (values override it) and the variables named in
    `unset` are removed from it; MODEL_NAME, GRPC_PORT and PORT are set from the arguments, and
    PYTHONPATH to the repository root. `python` defaults to the running interpreter.
    """

    def __init__(
        self,
        model: str | Path,
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        python: str | None = None,
        start_timeout_s: float = 180.0,
        unset: Sequence[str] = (),
    ) -> None:
        self.model = str(model)
        self.grpc_port = free_port()
        self.http_port = free_port()
        self.extra_env = dict(env or {})
        self.unset = tuple(unset)
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

    def start(self) -> ServerProcess:
        inherited = {k: v for k, v in os.environ.items() if k not in self.unset}
        env = {
            **inherited,
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
        deadline = time.monotonic() + self.start_timeout_s
        while self.health() != 200:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"server exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(f"server not healthy in time:\n{self.log_tail()}")
            time.sleep(0.2)
        return self

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

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""
