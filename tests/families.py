"""Tiny random checkpoints of the supported model families, written by transformers' own config
and model classes (float32 safetensors) with SmolLM2's tokenizer, so that they take text."""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import torch
import transformers

from engine.paths import model_path
from tools.prepare_models import BOS_ID, EOS_ID, PAD_ID, TOKENIZER_FILES, VOCAB_SIZE

SLIDING_WINDOW = 128
MAX_POSITIONS = 512
MAX_NEW_TOKENS = 16
"""The tests' generation length: one value, so that their transformers references (cached per
folder, prompt and length by tests/reference.py) are computed once per test process."""
GRANITE_MULTIPLIERS = {
    "embedding_multiplier": 2.0,
    "residual_multiplier": 0.5,
    "attention_multiplier": 0.15,
    "logits_scaling": 3.0,
}

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # name -> (transformers config class, its family's arguments)
    "llama": ("LlamaConfig", {"attention_bias": True, "tie_word_embeddings": False}),
    "granite": ("GraniteConfig", {**GRANITE_MULTIPLIERS, "tie_word_embeddings": True}),
    "granite-untied": (
        "GraniteConfig",
        {**GRANITE_MULTIPLIERS, "attention_bias": True, "tie_word_embeddings": False},
    ),
    "mistral": ("MistralConfig", {"sliding_window": SLIDING_WINDOW, "tie_word_embeddings": False}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
}
"""Each family once, Granite also untied; between them every knob is off its default: q/k/v and
o_proj biases (llama, granite-untied), q/k/v biases only (qwen2), each multiplier with a tied and
an untied table (granite), a window shorter than the context (mistral)."""


def _init_weights(model: torch.nn.Module, seed: int) -> None:
    """Deterministic, larger-than-default weights, as tools/prepare_models.py's tiny models have,
    so that greedy outputs are varied and top-2 logits rarely tie."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):  # tied weights appear once
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if name.endswith(".bias"):
                param.copy_(0.1 * noise)
            elif param.ndim == 1:  # RMSNorm weights
                scale = 8.0 if name == "model.norm.weight" else 1.0
                param.copy_(scale * (1.0 + 0.1 * noise))
            elif "embed_tokens" in name:
                param.copy_(0.1 * noise)
            else:
                param.copy_(0.15 * noise)


def write_checkpoint(variant: str, out: Path, seed: int = 1) -> Path:
    """Write `variant` (a key of VARIANTS) into the folder `out` and return it."""
    config_class, family_args = VARIANTS[variant]
    config = getattr(transformers, config_class)(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        dtype="float32",
        **family_args,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    _init_weights(model, seed)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer_dir = model_path("tiny-llama-gqa-tied")
    for name in TOKENIZER_FILES:
        shutil.copy2(tokenizer_dir / name, out / name)
    return out


@cache
def checkpoint(variant: str) -> Path:
    """`variant` written once per test process (so that transformers' references, cached by
    path in tests/reference.py, are shared between test modules), removed at exit."""
    return write_checkpoint(variant, _root() / variant)


@cache
def _root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="specserve-families-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


def retype(folder: Path, out: Path, model_type: str) -> Path:
    """A copy of the checkpoint at `folder` in `out` whose config.json says `model_type`."""
    shutil.copytree(folder, out)
    config_file = out / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "model_type": model_type}, indent=2))
    return out
