"""GPTQ checkpoints: tools/gptq_writer.py's output read by the engine equals the same files
dequantized by an independent unpacker (tests/quant_reference.py: numpy byte views from the
format's definition) for every format variant; the writer's round trip stays within half a
step; detection from the checkpoint's config; and each bad input is refused at start-up with
the file and the field named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.attention.torch_backend import TorchAttentionBackend
from engine.layers.quant_linear import QuantLinear
from engine.llm import LLM
from engine.models.llama import LlamaConfig, LlamaModel
from engine.models.loader import CheckpointError, load_weights
from engine.paths import model_path
from engine.quant.scheme import resolve_scheme
from tests.quant_reference import dequantized_weights, read_tensors
from tests.reference import require_model
from tools.gptq_writer import GptqOptions, write_gptq

TINY = "tiny-llama-gqa-tied"
UNTIED = "tiny-llama-mha-untied"

VARIANTS = {
    "4bit-g32-sym": GptqOptions(bits=4, group_size=32),
    "4bit-g16-asym-actorder": GptqOptions(bits=4, group_size=16, sym=False, act_order=True),
    "4bit-g48-partial-group": GptqOptions(bits=4, group_size=48, sym=False),
    "4bit-perchannel-v2": GptqOptions(
        bits=4, group_size=-1, sym=False, checkpoint_format="gptq_v2"
    ),
    "8bit-g32-asym-actorder-v2": GptqOptions(
        bits=8, group_size=32, sym=False, act_order=True, checkpoint_format="gptq_v2"
    ),
    "8bit-perchannel-sym-shards": GptqOptions(bits=8, group_size=-1, shards=3),
}


def _model(folder: Path, quantize: str | None = None) -> LlamaModel:
    config = LlamaConfig.from_folder(folder)
    scheme = resolve_scheme(quantize, folder)
    model = LlamaModel(
        config, TorchAttentionBackend(), torch.float32, torch.device("cpu"), quant=scheme
    )
    load_weights(model, folder)
    return model


def _layer_weights(model: LlamaModel) -> dict[str, torch.Tensor]:
    """Each HF projection's W [out, in] as the engine's quantized layers hold it."""
    out: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        for fused, names, sizes in (
            (
                attn.qkv_proj,
                ("q_proj", "k_proj", "v_proj"),
                (attn.q_size, attn.kv_size, attn.kv_size),
            ),
            (attn.o_proj, ("o_proj",), None),
            (mlp.gate_up_proj, ("gate_proj", "up_proj"), None),
            (mlp.down_proj, ("down_proj",), None),
        ):
            assert isinstance(fused, QuantLinear)
            w = fused.unpack_weight().dequantize()
            chunks = w.split(list(sizes)) if sizes else w.chunk(len(names))
            prefix = (
                "self_attn."
                if names[0].endswith(("q_proj", "k_proj", "v_proj", "o_proj"))
                else "mlp."
            )
            out |= {f"{p}{prefix}{n}.weight": c for n, c in zip(names, chunks, strict=True)}
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_loaded_weights_equal_the_independent_unpacker(variant: str, tmp_path: Path) -> None:
    src = require_model(model_path(TINY))
    folder = write_gptq(src, tmp_path / "gptq", VARIANTS[variant])
    expected = dequantized_weights(folder, src, "gptq")
    loaded = _layer_weights(_model(folder))
    assert loaded.keys() == expected.keys()
    for name, w in expected.items():
        assert torch.equal(loaded[name], w), name  # fp16 scale x small integer: exact in fp32


@pytest.mark.parametrize("variant", ["4bit-g32-sym", "4bit-g16-asym-actorder"])
def test_writer_rounds_to_the_nearest_step(variant: str, tmp_path: Path) -> None:
    """|W - dequantized W| <= half a step (the group's scale), plus the scale's fp16 rounding
    (relative 2**-11) times the 7.5 steps of the largest value: 0.5 + 4e-3 steps."""
    src = require_model(model_path(TINY))
    options = VARIANTS[variant]
    folder = write_gptq(src, tmp_path / "gptq", options)
    floats, tensors = read_tensors(src), read_tensors(folder)
    for name, w in dequantized_weights(folder, src, "gptq").items():
        base = name.removesuffix(".weight")
        step = tensors[f"{base}.scales"].float()[tensors[f"{base}.g_idx"].long()].t()  # [out, in]
        err = (floats[name] - w).abs()
        assert bool((err <= step * (0.5 + 4e-3)).all()), name


def test_act_order_loads_a_permutation(tmp_path: Path) -> None:
    src = require_model(model_path(TINY))
    folder = write_gptq(src, tmp_path / "gptq", VARIANTS["4bit-g16-asym-actorder"])
    layer = _model(folder).layers[0].self_attn.qkv_proj
    assert isinstance(layer, QuantLinear)
    weight = layer.unpack_weight()
    assert weight.perm is not None and weight.group_size == 16
    assert weight.zeros is not None


def test_partial_last_group_becomes_smaller_whole_groups(tmp_path: Path) -> None:
    """in 64 with group 48: GPTQ's groups of 48 and 16 columns are stored as groups of 16."""
    src = require_model(model_path(TINY))
    folder = write_gptq(src, tmp_path / "gptq", VARIANTS["4bit-g48-partial-group"])
    layer = _model(folder).layers[0].self_attn.qkv_proj
    assert isinstance(layer, QuantLinear)
    weight = layer.unpack_weight()
    assert weight.group_size == 16 and weight.scales.shape[1] == 4


@pytest.mark.parametrize("where", ["quantize_config.json", "config.json"])
def test_gptq_detected_from_either_config(where: str, tmp_path: Path) -> None:
    src = require_model(model_path(TINY))
    folder = write_gptq(src, tmp_path / "gptq", VARIANTS["4bit-g32-sym"])
    if where == "config.json":
        (folder / "quantize_config.json").unlink()
    else:
        config = json.loads((folder / "config.json").read_text())
        del config["quantization_config"]
        (folder / "config.json").write_text(json.dumps(config))
    scheme = resolve_scheme(None, folder)
    assert scheme is not None and (scheme.method, scheme.bits, scheme.group_size) == ("gptq", 4, 32)
    assert scheme.source == str(folder / where)


def _edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    if path.name == "config.json":
        data["quantization_config"].update(changes)
    else:
        data.update(changes)
    path.write_text(json.dumps(data))


def _corrupt_qweight(folder: Path) -> None:
    file = folder / "model.safetensors"
    tensors = load_file(str(file))
    name = "model.layers.1.mlp.down_proj.qweight"
    tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, str(file), metadata={"format": "pt"})


def _scatter_k_g_idx(folder: Path) -> None:
    file = folder / "model.safetensors"
    tensors = load_file(str(file))
    name = "model.layers.0.self_attn.k_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(file), metadata={"format": "pt"})


BAD_INPUTS = {
    # case: (quantize, edit of the written checkpoint, words the error must contain)
    "int8-on-gptq": ("int8", None, ["QUANTIZE=int8", "quantize_config.json", "gptq"]),
    "bits-3": (
        None,
        lambda f: (
            _edit_json(f / "quantize_config.json", bits=3),
            _edit_json(f / "config.json", bits=3),
        ),
        ["quantize_config.json", "bits 3"],
    ),
    "awq": (
        None,
        lambda f: (
            (f / "quantize_config.json").unlink(),
            _edit_json(f / "config.json", quant_method="awq"),
        ),
        ["config.json", "quant_method 'awq'", "gptq"],
    ),
    "configs-disagree": (
        None,
        lambda f: _edit_json(f / "config.json", group_size=64),
        ["quantize_config.json", "config.json", "group_size"],
    ),
    "corrupt-qweight": (
        None,
        _corrupt_qweight,
        ["model.safetensors", "model.layers.1.mlp.down_proj.qweight", "shape"],
    ),
    "fused-g_idx-differ": (
        None,
        _scatter_k_g_idx,
        ["model.safetensors", "g_idx", "fused part"],
    ),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_gptq_input_stops_start_up(case: str, tmp_path: Path) -> None:
    quantize, edit, words = BAD_INPUTS[case]
    src = require_model(model_path(TINY))
    folder = write_gptq(src, tmp_path / "gptq", VARIANTS["4bit-g32-sym"])
    if edit is not None:
        edit(folder)
    with pytest.raises(CheckpointError) as e:
        LLM(folder, max_num_tokens=256, quantize=quantize)
    for word in words:
        assert word in str(e.value), (word, str(e.value))


def test_quantize_gptq_on_a_float_checkpoint_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "float"
    shutil.copytree(require_model(model_path(TINY)), folder)
    with pytest.raises(
        CheckpointError, match=r"QUANTIZE=gptq does not match the checkpoint: .* float"
    ):
        LLM(folder, max_num_tokens=256, quantize="gptq")


def test_unsupported_quantize_value_is_refused() -> None:
    with pytest.raises(ValueError, match="quantization must be one of gptq, int8, got 'fp8'"):
        LLM(model_path(TINY), max_num_tokens=256, quantize="fp8")


def test_gptq_folder_without_quantize_is_served_quantized(tmp_path: Path) -> None:
    src = require_model(model_path(UNTIED))
    folder = write_gptq(src, tmp_path / "gptq", VARIANTS["4bit-g32-sym"])
    with LLM(folder, max_num_tokens=256) as llm:
        assert llm.runner.quant is not None and llm.runner.quant.method == "gptq"
        layers = [m for m in llm.runner.model.modules() if isinstance(m, QuantLinear)]
        assert len(layers) == 4 * llm.runner.config.num_layers
        assert len(llm.generate([[1, 2, 3]], 3)[0].token_ids) == 3
