"""The run: sections in order, each within its budget, a watchdog over the whole."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.gpu_check.environment import section_environment
from bench.gpu_check.exactness import section_exactness
from bench.gpu_check.kernels import section_kernels
from bench.gpu_check.loader import LOADER_CHILD, loader_child, section_loader
from bench.gpu_check.quant import section_quant
from bench.gpu_check.report import REPO, Ctx, Report, SectionTimeout, deadline, free_device_memory
from bench.gpu_check.server import SERVERS, section_server
from bench.gpu_check.sharded import section_sharded
from bench.gpu_check.speed import section_speed

SECTIONS = (
    "environment", "kernels", "exactness", "speed", "sharded", "loader", "server", "quant"
)  # fmt: skip
# Seconds per section on the GPU; the whole run must stay under 8 minutes. With a cold Triton
# cache the compiles fall in the sections that first launch each variant: `kernels` those of
# the 128-wide heads in fp16 and bf16 (MHA and GQA), before `speed` launches that layout;
# `exactness` those of the tiny models' heads, once per model and dtype, since each case builds
# one runner (whose start-up captures its graphs) and reuses it for the eager and speculative
# runs; `quant` those of the quantized products up to 16 rows. `sharded` runs only with
# two GPUs (with one it takes no time); each section's budget is capped by what is left of
# TOTAL_BUDGET_S. The budgets before `quant` sum to 460 s on one GPU: `quant`, last, gets what
# the others leave, so that it never shortens them.
BUDGETS = {
    "environment": 20.0,
    "kernels": 40.0,
    "exactness": 140.0,
    "speed": 150.0,
    "sharded": 60.0,
    "loader": 50.0,
    "server": 60.0,
    "quant": 60.0,
}
# The CPU dry run, with the Triton kernel in its interpreter, on a machine busy with other work.
SMALL_BUDGETS = {
    "environment": 30.0,
    "kernels": 90.0,
    "exactness": 300.0,
    "speed": 90.0,
    "sharded": 90.0,
    "loader": 60.0,
    "server": 90.0,
    "quant": 60.0,
}
TOTAL_BUDGET_S = 465.0  # the watchdog's limit: 15 s under 8 minutes
SMALL_TOTAL_BUDGET_S = 570.0  # the CPU dry run's, under the 10 minutes its test allows


SECTION_FNS: dict[str, Callable[[Ctx], None]] = {
    "environment": section_environment,
    "kernels": section_kernels,
    "exactness": section_exactness,
    "speed": section_speed,
    "sharded": section_sharded,
    "loader": section_loader,
    "server": section_server,
    "quant": section_quant,
}


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python3 -m bench.gpu_check",
        description="One prepared run that proves or disproves the CUDA path.",
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--small", action="store_true", help="tiny shapes everywhere")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=", ".join(SECTIONS))
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument(LOADER_CHILD, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.loader_child:
        loader_child(args.loader_child, args.device)
        return 0
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        print(f"unknown sections: {', '.join(unknown)} (choose from {', '.join(SECTIONS)})")
        return 2
    report = Report(args)
    dry = args.small or args.device == "cpu"
    budgets = SMALL_BUDGETS if dry else BUDGETS
    total_budget = SMALL_TOTAL_BUDGET_S if dry else TOTAL_BUDGET_S

    def watchdog() -> None:
        for server in SERVERS:  # the only child that outlives a call
            if server.proc is not None and server.proc.poll() is None:
                server.proc.kill()
        report.current = "main"
        report.check("run.watchdog", total_budget, "s", "FAIL")
        path = report.write()
        print(f"watchdog: the run passed {total_budget:.0f} s; wrote {path}", flush=True)
        os._exit(1)

    timer = threading.Timer(total_budget, watchdog)
    timer.daemon = True
    timer.start()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        ctx = Ctx(args.device, args.small, report, Path(tmp))
        for name in sections:
            report.current = name
            begin = time.monotonic()
            left_total = total_budget - 5 - (begin - report.start)
            budget = min(budgets[name], left_total)
            ctx.section_end = begin + budget
            entry = report.sections.setdefault(name, {})
            entry["budget_s"] = round(budget, 1)
            if budget < 3:
                report.check(f"{name}.skipped", "time", "-", "INFO")
                entry["status"] = "skipped"
                continue
            print(f"== {name} (budget {budget:.0f} s)", flush=True)
            try:
                with deadline(budget):
                    SECTION_FNS[name](ctx)
                entry["status"] = "ok"
            except SectionTimeout as e:
                entry["status"] = "timeout"
                report.error(name, f"timeout: {e}")
            except Exception as e:  # report it, go on to the next section
                entry["status"] = "error"
                entry["traceback"] = traceback.format_exc()
                report.error(name, f"{type(e).__name__}: {e}")
            entry["seconds"] = round(time.monotonic() - begin, 2)
            free_device_memory()
        report.current = "main"
    timer.cancel()
    report.check("run.wall", time.monotonic() - report.start, "s", "INFO")
    path = report.write()
    fails = [c["name"] for c in report.checks if c["status"] == "FAIL"]
    print(f"wrote {path}; {len(fails)} FAIL{': ' + ', '.join(fails) if fails else ''}", flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
