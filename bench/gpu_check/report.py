"""Reporting for the GPU check: CHECK lines, the JSON report, section deadlines, the run's
context and timing helpers."""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import signal
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
FP32_NEAR_TIE = 1e-4  # transformers' top-2 logit gap under which a float32 flip is allowed
FP16_NEAR_TIE = 0.05  # the same for float16
BOS_ID, EOS_ID = 1, 2
FINAL_NORM_SCALE = 2.0

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class SectionTimeout(BaseException):
    """Raised by SIGALRM when a section passes its deadline (a BaseException, so that the
    sub-steps' `except Exception` does not swallow it)."""


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.4g}"
    return str(value).replace(" ", "_") or "-"


class Report:
    """Collects CHECK lines and each section's details; written as JSON at the end (or by the
    watchdog)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.start = time.monotonic()
        self.checks: list[dict[str, Any]] = []
        self.sections: dict[str, dict[str, Any]] = {}
        self.current = "main"
        self.meta = {
            "device": args.device,
            "small": args.small,
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "python": sys.version.split()[0],
            "host": platform.node(),
        }
        self.path = Path(args.out) / f"gpu_check_{args.device}{'_small' if args.small else ''}.json"
        self._lock = threading.Lock()

    def check(self, name: str, value: Any, unit: str, status: str, **details: Any) -> None:
        assert status in ("PASS", "FAIL", "INFO")
        line = f"CHECK {name} {_fmt(value)} {unit or '-'} {status}"
        print(line, flush=True)
        with self._lock:
            self.checks.append(
                {"name": name, "value": value, "unit": unit, "status": status, **details}
            )
            self.sections.setdefault(self.current, {}).setdefault("checks", []).append(name)

    def detail(self, key: str, value: Any) -> None:
        with self._lock:
            self.sections.setdefault(self.current, {}).setdefault("details", {})[key] = value

    def error(self, section: str, message: str) -> None:
        text = " ".join(message.split()) or "error"
        if len(text) > 300:  # its start says what failed, its end (a log's tail) why
            text = f"{text[:100]} ... {text[-200:]}"
        self.check(f"{section}.error", text, "-", "FAIL")

    @property
    def failed(self) -> bool:
        return any(c["status"] == "FAIL" for c in self.checks)

    def write(self) -> Path:
        with self._lock:
            body = {
                **self.meta,
                "wall_s": round(time.monotonic() - self.start, 2),
                "failed": self.failed,
                "sections": self.sections,
                "checks": self.checks,
            }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(body, indent=2, default=str) + "\n")
        tmp.replace(self.path)
        return self.path


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise SectionTimeout in the main thread after `seconds` (between bytecodes: a single
    long C call finishes first; the run's watchdog covers a call that never returns)."""

    def on_alarm(signum: int, frame: Any) -> None:
        raise SectionTimeout(f"deadline of {seconds:.0f} s passed")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclass
class Ctx:
    device: str
    small: bool
    report: Report
    tmp: Path
    section_end: float = 0.0

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def judged(self) -> bool:
        """Speed figures are PASS/FAIL only on a GPU at full size; elsewhere they are INFO."""
        return self.cuda and not self.small

    def left(self) -> float:
        return self.section_end - time.monotonic()

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def step(self, name: str, fn: Callable[[], None], min_left: float = 0.0) -> None:
        """Run one sub-step, reporting its exception as a FAIL without ending the section;
        skipped (INFO) when less than `min_left` seconds are left of the section."""
        if self.left() < min_left:
            self.report.check(f"{name}.skipped", "time", "-", "INFO")
            return
        start = time.monotonic()
        try:
            fn()
        except Exception as e:  # every failure is a result here
            self.report.detail(f"{name}.traceback", traceback.format_exc())
            self.report.error(name, f"{type(e).__name__}: {e}")
        finally:
            self.report.detail(f"{name}.seconds", round(time.monotonic() - start, 2))


def timed(ctx: Ctx, fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Median seconds of `repeats` calls after `warmup` calls, synchronizing the device around
    each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        ctx.sync()
        start = time.perf_counter()
        fn()
        ctx.sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def status(ok: bool, judged: bool = True) -> str:
    if not judged:
        return "INFO"
    return "PASS" if ok else "FAIL"


def free_device_memory() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:
        pass
