"""Checkpoint formats and the errors a broken checkpoint must produce."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM
from engine.attention import TorchAttentionBackend
from engine.models.llama import LlamaConfig, LlamaModel
from engine.models.loader import CheckpointError, load_weights
from engine.paths import model_path
from tests.reference import compare_greedy, hf_greedy

PROMPT = [1, 504, 3458, 282, 4649, 314, 2]


@pytest.fixture
def gqa_copy(tmp_path: Path) -> Path:
    src = model_path("tiny-llama-gqa-tied")
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def _model(folder: Path) -> LlamaModel:
    config = LlamaConfig.from_folder(folder)
    return LlamaModel(config, TorchAttentionBackend(), torch.float32, torch.device("cpu"))


def test_pytorch_bin_checkpoint(gqa_copy: Path) -> None:
    """A `pytorch_model.bin` folder loads to the same model as its safetensors original."""
    state = load_file(gqa_copy / "model.safetensors")
    (gqa_copy / "model.safetensors").unlink()
    torch.save(state, gqa_copy / "pytorch_model.bin")
    out = LLM(gqa_copy, dtype="float32", max_num_tokens=1024).generate([PROMPT], 24)[0]
    ref = hf_greedy(model_path("tiny-llama-gqa-tied"), tuple(PROMPT), 24)
    compare_greedy(out.token_ids, ref)


def test_missing_tensor_names_file_and_tensor(gqa_copy: Path) -> None:
    file = gqa_copy / "model.safetensors"
    state = load_file(file)
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, file)
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors.*model\.layers\.1\.mlp\.up_proj"
    ):
        load_weights(_model(gqa_copy), gqa_copy)


def test_wrong_shape_names_file_and_tensor(gqa_copy: Path) -> None:
    file = gqa_copy / "model.safetensors"
    state = load_file(file)
    state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(state, file)
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*layers\.0\.self_attn\.k_proj"):
        load_weights(_model(gqa_copy), gqa_copy)


def test_truncated_file_names_file(gqa_copy: Path) -> None:
    file = gqa_copy / "model.safetensors"
    file.write_bytes(file.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_weights(_model(gqa_copy), gqa_copy)


def test_missing_shard_and_missing_checkpoint(tmp_path: Path) -> None:
    sharded = tmp_path / "sharded"
    shutil.copytree(model_path("tiny-llama-sharded"), sharded)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (sharded / shard).unlink()
    with pytest.raises(CheckpointError, match=re.escape(shard)):
        load_weights(_model(sharded), sharded)
    for f in sharded.glob("model*.safetensors*"):
        f.unlink()
    with pytest.raises(CheckpointError, match="no checkpoint found"):
        load_weights(_model(sharded), sharded)


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        LlamaConfig.from_folder(tmp_path)
