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
from engine.quant.reference import quantize_rows
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


def fake_quant_rows(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
    """A forward pre-hook: the input's rows quantized to int8 per row and back (the order of
    the columns does not change a row's quantization, so act-order needs no permutation)."""
    (x,) = args
    rows = x.reshape(-1, x.shape[-1])
    xq, sx = quantize_rows(rows)
    return ((xq.to(torch.float32) * sx[:, None]).reshape(x.shape),)


def fake_quant_slices(n: int) -> Callable[..., tuple[torch.Tensor]]:
    """A forward pre-hook quantizing each of `n` equal column slices of the input rows on its
    own: what `n` tensor-parallel ranks of a row-parallel layer each do with their slice."""

    def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        (x,) = args
        parts = [fake_quant_rows(module, (c,))[0] for c in x.chunk(n, dim=-1)]
        return (torch.cat(parts, dim=-1),)

    return hook


ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


def oracle_model(
    float_folder: Path,
    weights: dict[str, torch.Tensor],
    int8_activations: bool = True,
    num_shards: int = 1,
) -> PreTrainedModel:
    """transformers float32 with `weights` in place and, with `int8_activations`, every
    projection's input fake-quantized (`fake_quant_rows`; the row-parallel ones per shard's
    slice with `num_shards` > 1). A quantized LM head (`lm_head.weight` in `weights`) is untied
    from the float embedding table and its input fake-quantized too."""
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
            if num_shards > 1 and name.endswith(ROW_PARALLEL):
                module.register_forward_pre_hook(fake_quant_slices(num_shards))
            elif name.endswith(PROJECTIONS) or (name == "lm_head" and "lm_head.weight" in weights):
                module.register_forward_pre_hook(fake_quant_rows)
    return model


def oracle_greedy(model: PreTrainedModel, prompt_ids: list[int], max_new_tokens: int) -> Reference:
    return model_greedy(model, prompt_ids, max_new_tokens)
