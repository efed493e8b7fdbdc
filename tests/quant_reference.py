"""Independent oracles for quantized models: GPTQ tensors dequantized from the format's
definition (byte views and nibbles in numpy, not the engine's shifts), int8 weights quantized by
numpy, and transformers float32 running those weights with each projection's input rows
fake-quantized to int8 (the W?A8 product the CPU kernels compute)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, PreTrainedModel

from engine.models.loader import checkpoint_files
from engine.quant.reference import activation_group, dequantize_rows
from tests.reference import Reference, model_greedy

PROJECTIONS = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)  # fmt: skip


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    files, _ = checkpoint_files(folder)
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            out |= {name: st.get_tensor(name) for name in st.keys()}  # noqa: SIM118
    return out


def _nibbles_or_bytes(words: np.ndarray, bits: int) -> np.ndarray:
    """int32 [..., C] -> the unsigned values of each word along a new axis [..., C, 32 / bits],
    lowest first, from the little-endian bytes."""
    b = words.astype("<i4").view(np.uint8).reshape(*words.shape, 4)  # bytes, lowest first
    if bits == 8:
        return b.astype(np.int64)
    return np.stack([b & 0x0F, b >> 4], axis=-1).reshape(*words.shape, 8).astype(np.int64)


def gptq_dequantize(
    tensors: dict[str, torch.Tensor], base: str, bits: int, fmt: str
) -> torch.Tensor:
    """W [out, in] float32 of GPTQ layer `base`: scales[g, o] * (q[i, o] - zero[g, o]), g =
    g_idx[i], zero = stored + 1 in the "gptq" format."""
    qweight = tensors[f"{base}.qweight"].numpy()  # [in / pack, out]
    values = _nibbles_or_bytes(qweight, bits)  # [in / pack, out, pack]
    q = values.transpose(0, 2, 1).reshape(-1, qweight.shape[1])  # [in, out]
    zeros = _nibbles_or_bytes(tensors[f"{base}.qzeros"].numpy(), bits)  # [G, out / pack, pack]
    zero = zeros.reshape(zeros.shape[0], -1) + (1 if fmt == "gptq" else 0)  # [G, out]
    scales = tensors[f"{base}.scales"].float().numpy().astype(np.float64)  # [G, out]
    g = tensors[f"{base}.g_idx"].numpy().astype(np.int64)
    w = scales[g] * (q - zero[g])  # [in, out]
    return torch.from_numpy(w.T.astype(np.float32)).contiguous()


def int8_dequantize(w: torch.Tensor) -> torch.Tensor:
    """Per output row, in float32: scale = max |row| / 127, q = round half to even of row /
    scale, clamped to +-127 (a row of zeros stays zero)."""
    a = w.float().numpy()
    scale = np.abs(a).max(axis=1, keepdims=True) / np.float32(127.0)
    safe = np.where(scale > 0, scale, np.float32(1.0))
    q = np.clip(np.rint(a / safe), -127, 127)
    return torch.from_numpy((q * scale).astype(np.float32))


def dequantized_weights(folder: Path, float_folder: Path, method: str) -> dict[str, torch.Tensor]:
    """Every projection's dequantized W, by its HF name (`<layer>.weight`)."""
    if method == "int8":
        tensors = read_tensors(float_folder)
        return {n: int8_dequantize(t) for n, t in tensors.items() if _is_projection(n)}
    qc = json.loads((folder / "quantize_config.json").read_text())
    tensors = read_tensors(folder)
    bases = [n.removesuffix(".qweight") for n in tensors if n.endswith(".qweight")]
    return {
        f"{b}.weight": gptq_dequantize(tensors, b, qc["bits"], qc["checkpoint_format"])
        for b in bases
    }


def _is_projection(name: str) -> bool:
    return name.endswith(".weight") and any(f".{p}." in name for p in PROJECTIONS)


def fake_quant(x: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] with each row quantized to int8 and back as the int8 kernels see it: its
    columns taken in `order` (the weight's stored order; None: as they are), then `quantize_rows`
    in groups of `activation_group(K)`, and put back in place."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.float32)
    group = activation_group(rows.shape[1])
    if order is None:
        return dequantize_rows(rows, group).reshape(x.shape)
    out = torch.empty_like(rows)
    out[:, order] = dequantize_rows(rows[:, order], group)
    return out.reshape(x.shape)


def fake_quant_hook(
    orders: list[torch.Tensor | None],
) -> Callable[..., tuple[torch.Tensor]]:
    """A forward pre-hook: the input's columns cut into ``len(orders)`` equal slices (what as
    many tensor-parallel ranks of a row-parallel layer each hold; one slice otherwise), each
    fake-quantized on its own (`fake_quant`) in its order."""

    def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        (x,) = args
        parts = x.chunk(len(orders), dim=-1)
        return (torch.cat([fake_quant(c, o) for c, o in zip(parts, orders, strict=True)], -1),)

    return hook


def stored_order(g_idx: torch.Tensor) -> torch.Tensor | None:
    """The input columns sorted by their GPTQ group (stable), as a grouped kernel stores them;
    None when already sorted."""
    if bool((g_idx[1:] >= g_idx[:-1]).all()):
        return None
    return torch.from_numpy(np.argsort(g_idx.numpy(), kind="stable"))


def column_orders(folder: Path, method: str, num_shards: int = 1) -> dict[str, list]:
    """Each projection's stored column order per tensor-parallel slice (row-parallel layers cut
    into `num_shards` slices of their input, each ordered within itself), by module name."""
    if method == "int8":
        return {}
    tensors = read_tensors(folder)
    out: dict[str, list] = {}
    for name in tensors:
        if not name.endswith(".g_idx"):
            continue
        base = name.removesuffix(".g_idx")
        g = tensors[name].to(torch.int64)
        shards = num_shards if base.endswith(ROW_PARALLEL) else 1
        out[base] = [stored_order(part) for part in g.chunk(shards)]
    return out


ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


def oracle_model(
    float_folder: Path,
    weights: dict[str, torch.Tensor],
    int8_activations: bool = True,
    num_shards: int = 1,
    orders: dict[str, list] | None = None,
) -> PreTrainedModel:
    """transformers float32 with `weights` in place and, with `int8_activations`, every
    projection's input fake-quantized (`fake_quant_hook`: in the stored column order `orders`
    gives, by module name (`column_orders`; absent: as they are), the row-parallel ones per
    shard's slice with `num_shards` > 1). A quantized LM head (`lm_head.weight` in `weights`) is
    untied from the float embedding table and its input fake-quantized too."""
    orders = orders or {}
    model = AutoModelForCausalLM.from_pretrained(str(float_folder), dtype=torch.float32).eval()
    head = model.get_output_embeddings()
    if "lm_head.weight" in weights and head.weight is model.get_input_embeddings().weight:
        head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
        model.config.tie_word_embeddings = False
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, w in weights.items():
            params[name].copy_(w)
    if int8_activations:
        for name, module in model.named_modules():
            quantized_head = name == "lm_head" and "lm_head.weight" in weights
            if not (name.endswith(PROJECTIONS) or quantized_head):
                continue
            shards = num_shards if name.endswith(ROW_PARALLEL) else 1
            module.register_forward_pre_hook(fake_quant_hook(orders.get(name, [None] * shards)))
    return model


def oracle_greedy(model: PreTrainedModel, prompt_ids: list[int], max_new_tokens: int) -> Reference:
    return model_greedy(model, prompt_ids, max_new_tokens)
