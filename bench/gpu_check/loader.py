"""Section `loader`: a 4-layer 13B-width checkpoint as sharded safetensors and as .bin, loaded
in a fresh process: GB/s and host peak memory."""

from __future__ import annotations

import gc
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from bench.gpu_check.models import SPEED_13B, SPEED_SMALL, write_llama_config
from bench.gpu_check.report import REPO, Ctx

LOADER_CHILD = "--loader-child"


def loader_child(folder: str, device: str) -> None:
    """In a fresh process: build the model for `folder`'s config, load its checkpoint, print
    one JSON line (seconds, host RSS before and peak)."""
    import torch

    from engine.attention import TorchAttentionBackend
    from engine.models.llama import LlamaConfig, LlamaModel
    from engine.models.loader import load_weights

    config = LlamaConfig.from_folder(folder)
    dtype = torch.float16 if device.startswith("cuda") else torch.float32
    model = LlamaModel(config, TorchAttentionBackend(16), dtype, torch.device(device))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    before_kb = _status_kb("VmRSS")
    try:  # reset the peak RSS (VmHWM) to the current RSS: the peak of imports is not ours
        Path("/proc/self/clear_refs").write_text("5")
        peak_source = "VmHWM"
    except OSError:
        peak_source = "ru_maxrss"
    start = time.perf_counter()
    load_weights(model, folder)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if peak_source == "VmHWM":
        peak_kb = _status_kb("VmHWM")
    else:
        peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {"seconds": seconds, "rss_before_kb": before_kb, "peak_kb": peak_kb}
    print(json.dumps({**out, "peak_source": peak_source}))


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    return 0


def section_loader(ctx: Ctx) -> None:
    import torch
    from safetensors.torch import save_file

    r = ctx.report
    small = ctx.small or not ctx.cuda
    shape = dict(SPEED_SMALL if small else SPEED_13B)
    shape["num_hidden_layers"] = 2 if small else 4
    dtype_name = "float16" if ctx.cuda else "float32"
    dtype = getattr(torch, dtype_name)
    hidden, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}  # fmt: skip
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (hidden, hidden),
            p + "self_attn.v_proj.weight": (hidden, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
    # Random values made on the device (fast), then held on the host to be written.
    state = {
        name: torch.randn(s, device=ctx.device, dtype=dtype).mul_(0.02).cpu()
        for name, s in shapes.items()
    }
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    r.check("loader.checkpoint_bytes", nbytes / 1e9, "GB", "INFO")
    names = list(state)
    shard_count = 3
    per = math.ceil(len(names) / shard_count)

    st_dir = ctx.tmp / "loader-safetensors"
    bin_dir = ctx.tmp / "loader-bin"
    for d in (st_dir, bin_dir):
        d.mkdir(parents=True, exist_ok=True)
        write_llama_config(d, shape, dtype_name)
    start = time.perf_counter()
    weight_map: dict[str, str] = {}
    for k in range(shard_count):
        file = f"model-{k + 1:05d}-of-{shard_count:05d}.safetensors"
        part = names[k * per : (k + 1) * per]
        save_file({n: state[n] for n in part}, str(st_dir / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    index = {"metadata": {"total_size": nbytes}, "weight_map": weight_map}
    (st_dir / "model.safetensors.index.json").write_text(json.dumps(index) + "\n")
    r.check("loader.write_safetensors", time.perf_counter() - start, "s", "INFO")
    start = time.perf_counter()
    torch.save(state, bin_dir / "pytorch_model.bin")
    r.check("loader.write_bin", time.perf_counter() - start, "s", "INFO")
    del state
    gc.collect()

    for fmt, folder in (("safetensors", st_dir), ("bin", bin_dir)):

        def load(fmt: str = fmt, folder: Path = folder) -> None:
            cmd = [sys.executable, "-m", "bench.gpu_check", LOADER_CHILD, str(folder),
                   "--device", ctx.device]  # fmt: skip
            env = {**os.environ, "PYTHONPATH": str(REPO)}
            timeout = max(5.0, ctx.left() - 2)
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=timeout, check=False)  # fmt: skip
            if proc.returncode != 0:
                raise RuntimeError(f"loader child exited {proc.returncode}: {proc.stderr[-500:]}")
            out = json.loads(proc.stdout.strip().splitlines()[-1])
            r.detail(f"{fmt}.child", out)
            r.check(f"loader.{fmt}.load", nbytes / out["seconds"] / 1e9, "GB/s", "INFO")
            r.check(f"loader.{fmt}.seconds", out["seconds"], "s", "INFO")
            r.check(f"loader.{fmt}.host_peak", out["peak_kb"] / 2**20, "GiB", "INFO")
            over = (out["peak_kb"] - out["rss_before_kb"]) * 1024
            r.check(f"loader.{fmt}.host_peak_over_model_built", over / 2**30, "GiB", "INFO")

        ctx.step(f"loader.{fmt}", load, min_left=5)
    r.detail("note", "files were just written: loads read them from the page cache")
