"""Resident weight bytes per quantization format, and the KV tokens left on a device.

`weight_bytes` counts what the engine keeps for a Llama-family config: the projections of every
decoder layer as `QuantizedWeight`s (4 bits: half a byte a weight; 8 bits: a byte; plus float32
scales per group and output row, int8 zero points when asymmetric, an int64 permutation of the
input columns with act-order) or in the model dtype, and the embeddings, norms and LM head in the
model dtype (the head tied to the embeddings or not), unless the scheme quantizes the head
(`lm_head`): then the head is counted as a projection and the embedding table on its own. A
quantized layer keeps only its kernel's repacked copy: the same bytes, except that the CPU kernels
pad the output features to a multiple of 16 and the CUDA kernels keep asymmetric zero points as
int32. `kv_tokens` applies the engine's KV sizing rule (`engine.kv_sizing.num_blocks_from_memory`)
to a simulated device: the peak of the profile step is the weights plus an activation estimate, and
the CUDA context's memory outside torch is taken as 0.5 GiB.

    python -m tools.quant_memory [--model PATH]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from engine.kv_sizing import DeviceMemory, kv_block_bytes, num_blocks_from_memory
from engine.models.config import LlamaConfig
from engine.paths import default_model_path
from engine.quant.scheme import QuantScheme

GIB = 2**30
NON_TORCH_BYTES = GIB // 2
BLOCK_SIZE = 16

LLAMA2_13B = LlamaConfig(
    vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_layers=40, num_heads=40,
    num_kv_heads=40, head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
    max_position_embeddings=4096, tie_word_embeddings=False, torch_dtype="float16",
    bos_token_id=1, eos_token_ids=(2,),
)  # fmt: skip
"""Llama-2-13B's shapes."""


def _projection_bytes(out: int, n_in: int, scheme: QuantScheme | None, itemsize: int) -> int:
    if scheme is None:
        return out * n_in * itemsize
    if scheme.method == "int8":
        return out * n_in + 4 * out
    groups = 1 if scheme.group_size == -1 else math.ceil(n_in / scheme.group_size)
    size = out * n_in * scheme.bits // 8 + 4 * out * groups
    size += 0 if scheme.sym else out * groups
    return size + (8 * n_in if scheme.desc_act else 0)


def weight_bytes(config: LlamaConfig, scheme: QuantScheme | None, dtype: torch.dtype) -> int:
    """Resident bytes of the model's weights (see the module docstring). Group sizes that do not
    divide an input dimension count GPTQ's groups (the engine may store smaller ones)."""
    item = dtype.itemsize
    h, d = config.hidden_size, config.head_dim
    q, kv, inter = config.num_heads * d, config.num_kv_heads * d, config.intermediate_size
    per_layer = (
        _projection_bytes(q + 2 * kv, h, scheme, item)
        + _projection_bytes(h, q, scheme, item)
        + _projection_bytes(2 * inter, h, scheme, item)
        + _projection_bytes(h, inter, scheme, item)
        + 2 * h * item
    )
    table = config.vocab_size * h * item
    if scheme is not None and scheme.lm_head:  # the float table and a quantized head
        tables = table + _projection_bytes(config.vocab_size, h, scheme, item)
    else:
        tables = (1 if config.tie_word_embeddings else 2) * table
    return config.num_layers * per_layer + tables + h * item


def activation_bytes(config: LlamaConfig, num_tokens: int, dtype: torch.dtype) -> int:
    """An estimate of the profile step's activations for `num_tokens` rows: the widest
    product's output and input (gate_up, then SiLU-and-mul) plus the qkv and residual rows."""
    h, d = config.hidden_size, config.head_dim
    width = 3 * config.intermediate_size + (config.num_heads + 2 * config.num_kv_heads) * d + 3 * h
    return num_tokens * width * dtype.itemsize


def kv_tokens(
    config: LlamaConfig,
    scheme: QuantScheme | None,
    total_bytes: int,
    dtype: torch.dtype = torch.float16,
    memory_fraction: float = 0.9,
    max_num_batched_tokens: int = 2048,
) -> int:
    """KV tokens the sizing rule leaves on a device of `total_bytes` (0: the model does not fit)."""
    peak = weight_bytes(config, scheme, dtype) + activation_bytes(
        config, max_num_batched_tokens, dtype
    )
    memory = DeviceMemory(total=total_bytes, peak_allocated=peak, non_torch=NON_TORCH_BYTES)
    block = kv_block_bytes(config, BLOCK_SIZE, dtype)
    return num_blocks_from_memory(memory, memory_fraction, block) * BLOCK_SIZE


SCHEMES: dict[str, QuantScheme | None] = {
    "float16": None,
    "int8": QuantScheme("int8"),
    "gptq 8-bit g128": QuantScheme("gptq", bits=8, group_size=128),
    "gptq 4-bit g128": QuantScheme("gptq", bits=4, group_size=128),
    "gptq 4-bit g32": QuantScheme("gptq", bits=4, group_size=32),
    "gptq 4-bit g128 + LM head": QuantScheme("gptq", bits=4, group_size=128, lm_head=True),
    "gptq 4-bit g128 asym act-order": QuantScheme(
        "gptq", bits=4, group_size=128, sym=False, desc_act=True
    ),
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=default_model_path())
    a = p.parse_args(argv)
    model = LlamaConfig.from_folder(a.model)
    cpu = {"float32": None, **{k: v for k, v in SCHEMES.items() if k != "float16"}}
    base = weight_bytes(model, None, torch.float32)
    print(f"{a.model.name} on CPU (float32 elsewhere):\n| format | weight MiB | vs float32 |")
    print("|---|---|---|")
    for name, scheme in cpu.items():
        size = weight_bytes(model, scheme, torch.float32)
        print(f"| {name} | {size / 2**20:.1f} | {size / base:.2f} |")
    print("\nLlama-2-13B shapes, float16 elsewhere, KV in float16, memory fraction 0.9:")
    print("| format | weight GiB | KV tokens on 24 GiB | KV tokens on 80 GiB |\n|---|---|---|---|")
    for name, scheme in SCHEMES.items():
        size = weight_bytes(LLAMA2_13B, scheme, torch.float16)
        small, large = (kv_tokens(LLAMA2_13B, scheme, g * GIB) for g in (24, 80))
        print(f"| {name} | {size / GIB:.2f} | {small} | {large} |")


if __name__ == "__main__":
    main()
