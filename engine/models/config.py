"""The config of the Llama decoder and of the families that differ from it only in a few knobs,
chosen by config.json's `model_type`:

    model_type  differs from Llama in
    llama       -
    granite     embedding_multiplier, residual_multiplier, attention_multiplier, logits_scaling
    mistral     sliding_window
    qwen2       q/k/v projection biases; sliding_window when use_sliding_window is set

Every knob defaults to Llama's behaviour. A config without `model_type` is read as Llama's; any
other `model_type` is refused with a ValueError naming the supported ones, and so is a non-Granite
config that sets one of Granite's multipliers (transformers would ignore it, and so would the
engine, giving wrong text for what is likely a Granite checkpoint).

The engine does not mask attention to a sliding window. It serves at most `sliding_window` tokens
per request instead (`max_model_len`), so that the window, when there is one, never hides a token:
transformers' mask keeps key j for query i when i - j < sliding_window.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GRANITE_MULTIPLIERS = (
    "embedding_multiplier",
    "residual_multiplier",
    "attention_multiplier",
    "logits_scaling",
)


@dataclass(frozen=True)
class LlamaConfig:
    """The subset of an HF `config.json` this implementation reads: Llama's fields plus the
    knobs of the other families (neutral for Llama)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    model_type: str = "llama"
    qkv_bias: bool = False
    """q_proj, k_proj and v_proj have biases (qwen2; Llama's and Granite's attention_bias)."""
    o_proj_bias: bool = False
    """o_proj has a bias (Llama's and Granite's attention_bias)."""
    embedding_multiplier: float = 1.0
    """Scales the token embeddings before the first layer."""
    residual_multiplier: float = 1.0
    """Scales each attention and MLP output before it is added to the residual stream."""
    attention_multiplier: float | None = None
    """The softmax scale of q.k; None: 1 / sqrt(head_dim)."""
    logits_scaling: float = 1.0
    """Divides the logits."""
    sliding_window: int | None = None
    """Keys at least this many positions before the query are masked (in some layer); None: no
    window."""

    def max_model_len(self, requested: int | None) -> int:
        """Most tokens per request the engine serves: `requested` (default:
        max_position_embeddings), capped at `sliding_window` so that the window masks nothing."""
        length = requested or self.max_position_embeddings
        return length if self.sliding_window is None else min(length, self.sliding_window)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> LlamaConfig:
        """Read an HF config of a supported family (transformers 4.x or 5.x spelling); raise
        ValueError naming a missing or unsupported field or model_type."""
        model_type = cfg.get("model_type") or "llama"
        family = FAMILIES.get(model_type)
        if family is None:
            raise ValueError(
                f"model_type {model_type!r} is not supported; supported model types: "
                f"{', '.join(FAMILIES)}"
            )
        if model_type != "granite":
            present = [key for key in GRANITE_MULTIPLIERS if key in cfg]
            if present:
                raise ValueError(
                    f"model_type {model_type!r} does not read {', '.join(present)} (Granite's "
                    "multipliers), which this config sets: if it is a Granite checkpoint, set "
                    "model_type to 'granite'"
                )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            if key not in cfg:
                raise ValueError(f"config.json has no '{key}'")
        if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias is not supported")
        num_heads = int(cfg["num_attention_heads"])
        rope = dict(cfg.get("rope_parameters") or {})
        scaling = cfg.get("rope_scaling") or rope or None
        if scaling is not None:
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            if rope_type not in ("default", "linear", "llama3"):
                raise ValueError(f"rope_scaling type {rope_type!r} is not supported")
            scaling = None if rope_type == "default" else {**scaling, "rope_type": rope_type}
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        config = cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            model_type=model_type,
            **family(cfg),
        )
        if config.logits_scaling == 0:
            raise ValueError("logits_scaling must not be 0")
        if config.sliding_window is not None and config.sliding_window < 2:
            raise ValueError(f"sliding_window must be >= 2, got {config.sliding_window}")
        return config

    @classmethod
    def from_folder(cls, path: str | Path) -> LlamaConfig:
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"model config not found: {config_file}")
        try:
            return cls.from_dict(json.loads(config_file.read_text()))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{config_file}: {e}") from e


def _llama(cfg: dict[str, Any]) -> dict[str, Any]:
    bias = bool(cfg.get("attention_bias", False))
    return {"qkv_bias": bias, "o_proj_bias": bias}


def _granite(cfg: dict[str, Any]) -> dict[str, Any]:
    """transformers' defaults are 1.0 each; attention_multiplier replaces 1 / sqrt(head_dim)."""
    return _llama(cfg) | {key: float(cfg.get(key, 1.0)) for key in GRANITE_MULTIPLIERS}


def _mistral(cfg: dict[str, Any]) -> dict[str, Any]:
    window = cfg.get("sliding_window")
    return {"sliding_window": None if window is None else int(window)}


def _qwen2(cfg: dict[str, Any]) -> dict[str, Any]:
    """The window counts only with use_sliding_window and, where config.json lists
    `layer_types` (transformers 5), when some layer is a sliding one."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    layer_types = cfg.get("layer_types")
    if layer_types is not None and "sliding_attention" not in layer_types:
        window = None
    return {"qkv_bias": True, "sliding_window": None if window is None else int(window)}


FAMILIES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "llama": _llama,
    "granite": _granite,
    "mistral": _mistral,
    "qwen2": _qwen2,
}
"""model_type -> the reader of that family's knobs."""
