"""Tensor parallelism on this host: `python -m bench.tensor_parallel [--shards 1 3]`.

For each number of shards N, in a fresh interpreter, starts the offline engine split over N
processes and prints: the
start-up time, rank 0's weight tensors (MiB), every rank's resident memory (VmRSS, MiB; it also
holds Python, torch and the KV pool), and greedy decode tokens/s at batch 1 and 8 (ignore_eos,
`--max-new-tokens` each). The interpreter's own resident memory after importing the engine is
printed first, the floor under every rank's figure. Writes bench/results/tensor_parallel.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from engine.llm import LLM
from engine.parallel.runner import LeaderRunner
from engine.paths import default_model_path
from tools.server_process import free_port

RESULTS = Path(__file__).with_name("results") / "tensor_parallel.json"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"VmRSS:\s+(\d+) kB", status)
    return int(match.group(1)) / 1024 if match else float("nan")


def weight_mib(llm: LLM) -> float:
    model = llm.runner.model
    tensors = list(model.parameters())
    tensors += [t for lin in model.linears() for t in (lin.storage, lin.bias) if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def measure(model: Path, num_shards: int, max_new_tokens: int) -> dict[str, object]:
    start = time.perf_counter()
    with LLM(
        model, max_num_tokens=4096, tensor_parallel_size=num_shards, master_port=free_port()
    ) as llm:
        startup_s = time.perf_counter() - start
        pids = [os.getpid()]
        if isinstance(llm.runner, LeaderRunner):
            pids += [p.pid for p in llm.runner.ranks.processes.values() if p.pid is not None]
        llm.generate([PROMPT], 4)  # warm-up
        tokens_per_s = {}
        for batch in (1, 8):
            t0 = time.perf_counter()
            outs = llm.generate([PROMPT] * batch, max_new_tokens, ignore_eos=True)
            seconds = time.perf_counter() - t0
            tokens_per_s[batch] = sum(len(o.token_ids) for o in outs) / seconds
        return {
            "num_shards": num_shards,
            "startup_s": startup_s,
            "rank0_weights_mib": weight_mib(llm),
            "rss_mib": [rss_mib(pid) for pid in pids],
            "tokens_per_s": tokens_per_s,
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", type=Path, default=default_model_path())
    ap.add_argument("--shards", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--one", action="store_true", help="measure --shards[0] here, print JSON")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.model, args.shards[0], args.max_new_tokens)))
        return
    floor = rss_mib(os.getpid())
    print(f"model {args.model.name}; this interpreter after imports: {floor:.0f} MiB resident")
    rows = []
    for n in args.shards:
        cmd = [sys.executable, "-m", "bench.tensor_parallel", "--one", "--shards", str(n)]
        cmd += ["--model", str(args.model), "--max-new-tokens", str(args.max_new_tokens)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        rss = ", ".join(f"{r:.0f}" for r in row["rss_mib"])
        tps = row["tokens_per_s"]
        print(
            f"N={n}: start-up {row['startup_s']:.1f} s, rank 0 weights "
            f"{row['rank0_weights_mib']:.1f} MiB, resident per rank [{rss}] MiB, tokens/s "
            f"batch 1 {tps['1']:.1f}, batch 8 {tps['8']:.1f}"
        )
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"rss_floor_mib": floor, "runs": rows}, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
