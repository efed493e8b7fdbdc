"""Why the server sets a 0.5 ms GIL switch interval (`server.main.GIL_SWITCH_INTERVAL_S`).

Decodes with the engine in its own thread, as the server does, with and without a second thread
busy in Python (the event loop's stand-in under load), at Python's default interval (5 ms) and at
the server's, alternating the two; prints tokens/s of each run.

    python -m bench.gil_switch [--model PATH] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

from engine import LLM
from engine.paths import model_path
from server.main import GIL_SWITCH_INTERVAL_S

PROMPTS = ["Tell me a story about the sea."] * 4
NEW_TOKENS = 32
DEFAULT_INTERVAL_S = 0.005


def _busy(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i * i


def tokens_per_s(llm: LLM, interval_s: float, contended: bool) -> float:
    """One decode of PROMPTS in a thread at `interval_s`, beside a busy thread if `contended`."""
    sys.setswitchinterval(interval_s)
    stop = threading.Event()
    busy = threading.Thread(target=_busy, args=(stop,), daemon=True)
    if contended:
        busy.start()
    elapsed: list[float] = []

    def decode() -> None:
        t0 = time.perf_counter()
        llm.generate(PROMPTS, NEW_TOKENS)
        elapsed.append(time.perf_counter() - t0)

    worker = threading.Thread(target=decode)
    worker.start()
    worker.join()
    stop.set()
    if contended:
        busy.join()
    return len(PROMPTS) * NEW_TOKENS / elapsed[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(model_path("SmolLM2-135M-Instruct")))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(args.model)
    llm.generate(PROMPTS, 8)  # warm-up
    intervals = (DEFAULT_INTERVAL_S, GIL_SWITCH_INTERVAL_S)
    for contended in (False, True):
        rates: dict[float, list[float]] = {s: [] for s in intervals}
        for _ in range(args.rounds):
            for s in intervals:
                rates[s].append(tokens_per_s(llm, s, contended))
        label = "busy Python thread" if contended else "no other thread"
        for s in intervals:
            runs = ", ".join(f"{r:.0f}" for r in rates[s])
            print(f"{label:18}  interval {s * 1e3:>4g} ms: {runs} tokens/s")


if __name__ == "__main__":
    main()
