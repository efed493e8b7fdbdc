"""The processes of ranks 1..N-1, started and watched by rank 0.

Ranks run in `spawn`ed daemon processes (a fresh interpreter each: no forked CUDA or thread
state). A monitor thread on rank 0 waits on their sentinels: a rank that exits before `stop`
is a failure, reported once to `on_failure` with the rank and its exit code or signal. A rank
exits by itself when rank 0's process is gone.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import signal
import threading
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

logger = logging.getLogger(__name__)


def describe_exit(code: int | None) -> str:
    """'exited with code 1' or 'was killed by SIGKILL' for a process's exit code."""
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class ShardProcesses:
    """Starts `target(rank, *args)` for ranks 1..size-1 and reports the first failure."""

    def __init__(self, size: int, target: Callable[..., None], args: tuple[Any, ...]) -> None:
        context = multiprocessing.get_context("spawn")
        self.processes: dict[int, BaseProcess] = {
            rank: context.Process(
                target=target, args=(rank, *args), name=f"specserve-rank-{rank}", daemon=True
            )
            for rank in range(1, size)
        }
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        """Called once, on the monitor thread or the caller of `fail`, with the first
        failure's message."""
        self._stopping = False
        self._lock = threading.Lock()
        self._exits: dict[int, int | None] = {}  # rank -> exit code, as the monitor reaped it
        self._exited = threading.Condition(self._lock)
        for rank, process in self.processes.items():
            process.start()
            logger.info("tensor parallelism: rank %d is process %s", rank, process.pid)
        self._monitor = threading.Thread(target=self._watch, name="shard-monitor", daemon=True)
        self._monitor.start()

    def fail(self, message: str, grace_s: float = 0.0) -> None:
        """Record the group's failure (the first one counts) and report it. A rank that has
        exited, or exits within `grace_s` (the error a collective raised is often the first
        sign of a peer's death), is named instead of `message`. Only the monitor thread reaps
        the ranks (two threads waiting on one child race: one of them sees no exit code)."""
        with self._lock:
            if grace_s:
                self._exited.wait_for(lambda: bool(self._exits), timeout=grace_s)
            if self.failure is not None or self._stopping:
                return
            if self._exits:
                rank = min(self._exits)
                message = f"shard rank {rank} {describe_exit(self._exits[rank])}"
            self.failure = message
        logger.error("tensor parallelism failed: %s", message)
        if self.on_failure is not None:
            self.on_failure(message)

    def _watch(self) -> None:
        alive = dict(self.processes)
        while alive:
            sentinels = {p.sentinel: rank for rank, p in alive.items()}
            for sentinel in multiprocessing.connection.wait(list(sentinels)):
                rank = sentinels[sentinel]  # type: ignore[index]
                process = alive.pop(rank)
                process.join()
                with self._lock:
                    self._exits[rank] = process.exitcode
                    self._exited.notify_all()
                self.fail(f"shard rank {rank} {describe_exit(process.exitcode)}")

    def stop(self, timeout: float) -> None:
        """Wait up to `timeout` s for every rank to exit (after it was told to), then kill
        the rest."""
        with self._lock:
            self._stopping = True
        for process in self.processes.values():
            process.join(timeout)
        for rank, process in self.processes.items():
            if process.is_alive():
                logger.warning("shard rank %d did not stop in %.0f s: killing it", rank, timeout)
                process.kill()
                process.join()
