"""`make gpu-check` (bench/gpu_check) as a CPU dry run: `--device cpu --small` runs every
section with tiny shapes, so that the one GPU run it is made for does not die of a bug that a
CPU could have shown. It starts the real server (its `server` section), hence this folder.

The dry run must reach the code the GPU run depends on: the Triton kernel (in Triton's
interpreter) at the 13B head layouts, the CUDA-graph step (its static buffers, run eagerly)
compared with eager steps of the same runner, two tensor-parallel ranks, and the Triton kernels
of quantized weights. The sections count what they reached (calls of `TritonBackend.forward`,
`StepGraphs.run` and `TritonQuantLinear.__call__`); those counts are asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.gpu_check import SECTIONS

REPO = Path(__file__).resolve().parents[2]


def test_cpu_dry_run_passes_every_section(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--small", "--out", tmp_path],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    lines = [line.split() for line in proc.stdout.splitlines() if line.startswith("CHECK ")]
    assert all(len(fields) == 5 for fields in lines), [f for f in lines if len(f) != 5]
    assert not [f for f in lines if f[-1] == "FAIL"], output[-4000:]
    assert all(f[-1] in ("PASS", "INFO") for f in lines)

    result = json.loads((tmp_path / "gpu_check_cpu_small.json").read_text())
    assert set(SECTIONS) <= set(result["sections"])
    assert all(result["sections"][s]["status"] == "ok" for s in SECTIONS), result["sections"]
    assert not result["failed"]
    assert len(result["checks"]) == len(lines)

    by_name = {f[1]: f[-1] for f in lines}
    exact = {name: st for name, st in by_name.items() if name.startswith("exactness.")}
    identical = [n for n in exact if n.endswith(".identical")]
    on_off = [n for n in exact if n.endswith(".on_equals_off")]
    # 2 tiny models x {float32, float16}; speculation: a random speculator and scripted drafts,
    # except in the case on the Triton interpreter (scripted drafts only).
    assert len(identical) == 4 and len(on_off) == 7, sorted(exact)
    assert all(exact[n] == "PASS" for n in identical + on_off)
    assert all(by_name[n] == "PASS" for n in by_name if n.endswith("spec_scripted.accepted"))
    for name in ("env.copy_bandwidth", "speed.decode_b1.over_bound", "speed.verify.rows16"):
        assert name in by_name, name
    assert any(n.startswith("loader.safetensors.") for n in by_name)
    assert any(n.startswith("loader.bin.") for n in by_name)
    assert any(n.startswith("server.") for n in by_name)

    values = {f[1]: f[2] for f in lines}
    kernels = [n for n in by_name if n.startswith("kernels.") and n.endswith(".max_error")]
    assert len(kernels) == 4 and all(by_name[n] == "PASS" for n in kernels), kernels
    assert {n.split(".")[1] for n in kernels} == {"mha_40x128", "gqa_40q_8kv_x128"}
    triton_case = "exactness.tiny-mha-untied.float32"
    for name in ("kernels.triton_launches", f"{triton_case}.triton_launches"):
        assert by_name[name] == "PASS" and int(values[name]) > 0, name
    assert by_name[f"{triton_case}.graph_steps"] == "PASS"
    assert int(values[f"{triton_case}.graph_steps"]) > 0
    assert by_name[f"{triton_case}.graphs_vs_eager"] == "PASS"
    assert by_name["sharded.equals_one_shard"] == "PASS"

    # The quantized products (small shapes in the interpreter): each against its reference.
    quant = [n for n in by_name if n.startswith("quant.") and n.endswith(".max_error")]
    assert len(quant) == 8 and all(by_name[n] == "PASS" for n in quant), quant
    assert by_name["quant.kernel_calls"] == "PASS" and int(values["quant.kernel_calls"]) > 0
    for fmt in ("fp16", "gptq4_g128", "int8_w8a8"):
        assert f"quant.{fmt}.rows1.layer_time" in by_name, fmt
