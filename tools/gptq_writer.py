"""Write a GPTQ checkpoint of a float Llama-family folder, for tests and measurements.

Round-to-nearest (no calibration) into GPTQ's storage, as AutoGPTQ / transformers / GPTQModel write
it: per linear layer of the decoder (q, k, v, o, gate, up, down) `qweight` int32 [in / pack, out],
`qzeros` int32 [groups, out / pack], `scales` fp16 [groups, out], `g_idx` int32 [in] (pack = 32 /
bits, lowest bits first) and, as AutoGPTQ does, a zero `bias`; everything else (embeddings, norms,
the LM head) is copied as it is, except with `--lm-head`: the LM head is quantized too
(`lm_head.qweight`, ... and `"lm_head": true`, as GPTQModel writes it), and a tied model is written
untied (`tie_word_embeddings` false): its float table stays `model.embed_tokens.weight` and the head
becomes a layer of its own. Options: 4 or 8 bits, any group size (-1: one group per row; a size that
does not divide the input leaves a shorter last group, as GPTQ does), symmetric (zero point
2**(bits-1)) or asymmetric zeros, the "gptq" format (zero points stored minus one) or "gptq_v2",
act-order (`--act-order`: the columns are quantized in the order of decreasing norm over the layers
sharing the input, q/k/v and gate/up, which is how GPTQ orders them by its Hessian's diagonal; g_idx
records it), safetensors shards.

    python -m tools.gptq_writer SRC DST --bits 4 --group-size 128 [--act-order] [--asym]
        [--lm-head]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.models.loader import checkpoint_files, iter_tensors

LINEAR_GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)
"""The decoder layer's linear layers, by the input they share."""


@dataclass(frozen=True)
class GptqOptions:
    bits: int = 4
    group_size: int = 128
    sym: bool = True
    act_order: bool = False
    checkpoint_format: str = "gptq"  # "gptq": zeros stored minus one; "gptq_v2": as they are
    shards: int = 1
    zero_bias: bool = True
    lm_head: bool = False  # quantize the LM head too (untying a tied one)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """int64 [R * pack, C] of unsigned `bits`-bit values -> int32 [R, C]."""
    pack = 32 // bits
    v = values.reshape(-1, pack, values.shape[1])
    words = torch.zeros(v.shape[0], v.shape[2], dtype=torch.int64)
    for j in range(pack):
        words |= v[:, j] << (bits * j)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_columns(values: torch.Tensor, bits: int) -> torch.Tensor:
    """int64 [R, C * pack] of unsigned `bits`-bit values -> int32 [R, C]."""
    return pack_rows(values.t().contiguous(), bits).t().contiguous()


def column_order(weights: list[torch.Tensor], act_order: bool) -> torch.Tensor:
    """The order GPTQ visits the input columns: by decreasing norm over `weights` (all [*, in])
    with act-order, else the identity."""
    n = weights[0].shape[1]
    if not act_order:
        return torch.arange(n)
    norms = torch.cat(weights).to(torch.float64).square().sum(dim=0)
    return torch.sort(norms, descending=True, stable=True).indices


def quantize_layer(w: torch.Tensor, order: torch.Tensor, o: GptqOptions) -> dict[str, torch.Tensor]:
    """Float W [out, in] -> its GPTQ tensors (round to nearest, groups over the columns in
    `order`)."""
    w = w.to(torch.float32)
    out, n = w.shape
    maxq = (1 << o.bits) - 1
    size = n if o.group_size == -1 else o.group_size
    groups = math.ceil(n / size)
    position = torch.empty(n, dtype=torch.int64)
    position[order] = torch.arange(n)
    g_idx = position // size  # [in]: the group of each input column
    wp = w[:, order]
    q_perm = torch.empty(out, n, dtype=torch.int64)
    scales = torch.empty(groups, out, dtype=torch.float16)
    zeros = torch.empty(groups, out, dtype=torch.int64)
    for g in range(groups):
        block = wp[:, g * size : (g + 1) * size]
        if o.sym:
            amax = block.abs().amax(dim=1)
            scale = 2 * amax / maxq
            zero = torch.full((out,), (maxq + 1) // 2, dtype=torch.int64)
        else:
            lo = block.amin(dim=1).clamp(max=0)
            hi = block.amax(dim=1).clamp(min=0)
            scale = (hi - lo) / maxq
            zero = torch.round(-lo / torch.where(scale > 0, scale, 1)).to(torch.int64)
            if o.checkpoint_format == "gptq":
                zero = zero.clamp(min=1)  # "gptq" stores zero - 1, which must not be negative
        scale16 = torch.where(scale > 0, scale, torch.ones_like(scale)).to(torch.float16)
        s = scale16.to(torch.float32)[:, None]
        q = torch.round(block / s).to(torch.int64) + zero[:, None]
        q_perm[:, g * size : (g + 1) * size] = q.clamp(0, maxq)
        scales[g], zeros[g] = scale16, zero
    q = torch.empty_like(q_perm)
    q[:, order] = q_perm  # back to the checkpoint's column order
    stored_zeros = zeros - 1 if o.checkpoint_format == "gptq" else zeros
    return {
        "qweight": pack_rows(q.t().contiguous(), o.bits),
        "qzeros": pack_columns(stored_zeros, o.bits),
        "scales": scales,
        "g_idx": g_idx.to(torch.int32),
    }


def quantize_config(o: GptqOptions) -> dict[str, object]:
    return {
        "quant_method": "gptq",
        "bits": o.bits,
        "group_size": o.group_size,
        "desc_act": o.act_order,
        "sym": o.sym,
        "damp_percent": 0.01,
        "static_groups": False,
        "true_sequential": True,
        "checkpoint_format": o.checkpoint_format,
        "lm_head": o.lm_head,
    }


def write_gptq(src: Path, dst: Path, o: GptqOptions) -> Path:
    """Write the GPTQ checkpoint of the float folder `src` into `dst` (created); returns dst."""
    if o.bits not in (2, 4, 8):
        raise ValueError(f"bits must divide 32 (2, 4 or 8), got {o.bits}")
    dst.mkdir(parents=True, exist_ok=True)
    files, _ = checkpoint_files(src)
    state = {name: t for f in files for name, t in iter_tensors(f)}
    out: dict[str, torch.Tensor] = {}
    layers = sorted({n.split(".")[2] for n in state if n.startswith("model.layers.")}, key=int)
    quantized: set[str] = set()
    for i in layers:
        for group in LINEAR_GROUPS:
            names = [f"model.layers.{i}.{m}" for m in group]
            order = column_order([state[f"{n}.weight"] for n in names], o.act_order)
            for n in names:
                w = state[f"{n}.weight"]
                for field, t in quantize_layer(w, order, o).items():
                    out[f"{n}.{field}"] = t
                if o.zero_bias and f"{n}.bias" not in state:
                    out[f"{n}.bias"] = torch.zeros(w.shape[0], dtype=torch.float16)
                quantized.add(f"{n}.weight")
    if o.lm_head:
        head = state.get("lm_head.weight", state["model.embed_tokens.weight"])
        order = column_order([head], o.act_order)
        out |= {f"lm_head.{field}": t for field, t in quantize_layer(head, order, o).items()}
        quantized.add("lm_head.weight")
    out |= {n: t.contiguous() for n, t in state.items() if n not in quantized}
    _save(out, dst, o.shards)
    weights = (".safetensors", ".bin", ".index.json")
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(weights) and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantize_config(o)
    if o.lm_head:
        config["tie_word_embeddings"] = False
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    (dst / "quantize_config.json").write_text(json.dumps(quantize_config(o), indent=2))
    return dst


def _save(tensors: dict[str, torch.Tensor], dst: Path, shards: int) -> None:
    """The tensors in `shards` safetensors files, readable by all (safetensors writes them
    owner-only, which a container's unprivileged user cannot read)."""
    if shards <= 1:
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
        (dst / "model.safetensors").chmod(0o644)
        return
    names = sorted(tensors)
    per = math.ceil(len(names) / shards)
    weight_map: dict[str, str] = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[k * per : (k + 1) * per]}
        save_file(part, str(dst / file), metadata={"format": "pt"})
        (dst / file).chmod(0o644)
        weight_map |= dict.fromkeys(part, file)
    index = {"metadata": {}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", type=Path, help="float model folder")
    p.add_argument("dst", type=Path, help="output folder")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--asym", action="store_true", help="asymmetric zero points")
    p.add_argument("--act-order", action="store_true")
    p.add_argument("--format", choices=("gptq", "gptq_v2"), default="gptq")
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--lm-head", action="store_true", help="quantize the LM head too")
    a = p.parse_args(argv)
    options = GptqOptions(
        a.bits, a.group_size, not a.asym, a.act_order, a.format, a.shards, lm_head=a.lm_head
    )
    print(write_gptq(a.src, a.dst, options))


if __name__ == "__main__":
    main()
