"""Logging set-up: plain lines, or one JSON object per line (JSON_OUTPUT), and the Kubernetes
termination log that receives a fatal error's message (TGIS's launcher writes its panics there).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from datetime import UTC, datetime
from types import TracebackType

PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

logger = logging.getLogger("specserve")


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line: `timestamp` (UTC, ISO 8601, microseconds),
    `level`, `logger`, `message`, and `exception` (the formatted traceback) when the record
    carries one."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "timestamp": datetime.fromtimestamp(record.created, UTC)
            .isoformat(timespec="microseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False)


def setup_logging(level: str, json_output: bool) -> None:
    """Log to stdout at `level`, as JSON lines when `json_output`. Python warnings and uncaught
    exceptions in threads go through logging too, so that every line has the same format."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(JsonFormatter() if json_output else logging.Formatter(PLAIN_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    logging.captureWarnings(True)
    threading.excepthook = _log_thread_exception


def _log_thread_exception(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    exc_info: tuple[type[BaseException], BaseException, TracebackType | None] = (
        args.exc_type,
        args.exc_value or args.exc_type(),
        args.exc_traceback,
    )
    name = args.thread.name if args.thread is not None else "?"
    logger.error("uncaught exception in thread %s", name, exc_info=exc_info)


TERMINATION_LOG_MAX_BYTES = 4096
"""Kubernetes keeps at most this much of a termination message."""


def write_termination_log(message: str, path: str | None, create: bool = True) -> bool:
    """Write `message` (clipped to TERMINATION_LOG_MAX_BYTES) to the termination log at `path`
    (None: nowhere), replacing its content; with `create` False only when the file exists (the
    kubelet mounts it). False when nothing was written."""
    if path is None or (not create and not os.path.exists(path)):
        return False
    data = message.encode("utf-8")[:TERMINATION_LOG_MAX_BYTES].decode("utf-8", "ignore")
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(data + "\n")
    except OSError:
        return False
    return True
