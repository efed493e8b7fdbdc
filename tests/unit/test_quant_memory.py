"""tools/quant_memory.py's weight bytes equal what a loaded model holds, for float32 and each
quantized format; and the KV tokens a 13B model leaves on simulated 24 and 80 GiB devices
grow as its weights shrink (the figures docs/quantization.md quotes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.attention.torch_backend import TorchAttentionBackend
from engine.layers.linear import Linear
from engine.layers.quant_linear import QuantLinear
from engine.models.llama import LlamaConfig, LlamaModel
from engine.models.loader import load_weights
from engine.paths import model_path
from engine.quant.scheme import resolve_scheme
from tests.reference import require_model
from tools.gptq_writer import GptqOptions, write_gptq
from tools.quant_memory import GIB, LLAMA2_13B, SCHEMES, kv_tokens, weight_bytes

FORMATS: dict[str, GptqOptions | str | None] = {
    "float32": None,
    "int8": "int8",
    "gptq-4bit-g32-sym": GptqOptions(bits=4, group_size=32),
    "gptq-4bit-g16-asym-actorder": GptqOptions(bits=4, group_size=16, sym=False, act_order=True),
    "gptq-8bit-perchannel": GptqOptions(bits=8, group_size=-1),
}


def _resident_bytes(model: LlamaModel) -> int:
    tensors = list(model.parameters())
    for m in model.modules():
        if isinstance(m, Linear):
            tensors += [t for t in (m.storage, m.bias) if t is not None]
    quantized = sum(m.weight_bytes() for m in model.modules() if isinstance(m, QuantLinear))
    return sum(t.numel() * t.element_size() for t in tensors) + quantized


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", ["tiny-llama-gqa-tied", "tiny-llama-mha-untied"])
def test_weight_bytes_are_what_the_model_holds(name: str, fmt: str, tmp_path: Path) -> None:
    folder, option = require_model(model_path(name)), FORMATS[fmt]
    if isinstance(option, GptqOptions):
        folder = write_gptq(folder, tmp_path / "gptq", option)
    scheme = resolve_scheme(option if isinstance(option, str) else None, folder)
    config = LlamaConfig.from_folder(folder)
    model = LlamaModel(
        config, TorchAttentionBackend(), torch.float32, torch.device("cpu"), None, None, scheme
    )
    load_weights(model, folder)
    assert _resident_bytes(model) == weight_bytes(config, scheme, torch.float32)


def test_13b_gptq_4bit_leaves_kv_room_where_float16_does_not_fit() -> None:
    float16, gptq4 = SCHEMES["float16"], SCHEMES["gptq 4-bit g128"]
    assert weight_bytes(LLAMA2_13B, float16, torch.float16) > 24 * GIB * 0.9
    assert kv_tokens(LLAMA2_13B, float16, 24 * GIB) == 0
    assert weight_bytes(LLAMA2_13B, gptq4, torch.float16) < 7 * GIB
    assert kv_tokens(LLAMA2_13B, gptq4, 24 * GIB) >= 16384
    assert kv_tokens(LLAMA2_13B, gptq4, 80 * GIB) > kv_tokens(LLAMA2_13B, float16, 80 * GIB)
