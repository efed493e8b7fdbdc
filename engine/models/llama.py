"""Llama (Llama-2/3, SmolLM2) over a paged KV cache.

The model takes one flat batch of new tokens from many sequences (prompt chunks, decode tokens,
draft-tree tokens) and explicit attention metadata; it never sees requests or sequences.
`qkv_proj` and `gate_up_proj` each fuse several projections into one matrix product: the output's
columns are q, k, v by heads, and gate then up.

With `kernels` (CPU float32), the glue between matrix products runs as fused C kernels
(`engine/kernels/cpu.py`): residual add + RMSNorm, RoPE in place, SiLU-and-mul. Without them it runs
the same maths as ATen ops.

The forward passes call submodules' `forward` directly, skipping `nn.Module.__call__`'s hook
dispatch on every call of a step: forward hooks on submodules do not run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata, KVCache
from engine.kernels.cpu import CpuKernels
from engine.layers.linear import Linear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RopeStep, RotaryEmbedding
from engine.models.loader import WeightTarget


@dataclass(frozen=True)
class LlamaConfig:
    """The subset of an HF `config.json` this implementation reads."""

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

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> LlamaConfig:
        """Read an HF Llama config (transformers 4.x or 5.x spelling); raise ValueError naming a
        missing or unsupported field."""
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            if key not in cfg:
                raise ValueError(f"config.json has no '{key}'")
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
        return cls(
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
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> LlamaConfig:
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"model config not found: {config_file}")
        try:
            return cls.from_dict(json.loads(config_file.read_text()))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{config_file}: {e}") from e


class Attention(nn.Module):
    def __init__(
        self,
        config: LlamaConfig,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        kernels: CpuKernels | None = None,
    ) -> None:
        super().__init__()
        self.kernels = kernels
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        hidden = config.hidden_size
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, dtype=dtype, device=device)
        self.o_proj = Linear(self.q_size, hidden, dtype=dtype, device=device)
        self.rotary = rotary
        self.backend = backend

    def forward(
        self,
        x: torch.Tensor,  # [N, hidden]
        rope: RopeStep,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [N, hidden]
        n, q_size, kv_size = x.shape[0], self.q_size, self.kv_size
        qkv = self.qkv_proj.forward(x)  # [N, q_size + 2 * kv_size]
        if rope.cos_sin is None:
            assert self.kernels is not None
            heads = self.num_heads + self.num_kv_heads
            self.kernels.rope_(qkv, heads, self.head_dim, self.rotary.table, rope.positions)
            q = qkv[:, :q_size].view(n, self.num_heads, self.head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(n, self.num_kv_heads, self.head_dim)
        else:
            qk = qkv[:, : q_size + kv_size].view(n, -1, self.head_dim)
            qk = self.rotary.rotate(qk, rope.cos_sin)  # [N, H + kvH, D]
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, q_size + kv_size :].view(n, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, kv_cache, attn_metadata)  # [N, H, D]
        return self.o_proj.forward(out.reshape(n, self.q_size))


class MLP(nn.Module):
    def __init__(
        self,
        config: LlamaConfig,
        dtype: torch.dtype,
        device: torch.device,
        kernels: CpuKernels | None = None,
    ) -> None:
        super().__init__()
        self.kernels = kernels
        self.intermediate_size = config.intermediate_size
        hidden = config.hidden_size
        self.gate_up_proj = Linear(hidden, 2 * self.intermediate_size, dtype=dtype, device=device)
        self.down_proj = Linear(self.intermediate_size, hidden, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)  # [N, 2 * intermediate]
        if self.kernels is not None:
            return self.down_proj.forward(self.kernels.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj.forward(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: LlamaConfig,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        kernels: CpuKernels | None = None,
    ) -> None:
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.input_layernorm = RMSNorm(hidden, eps, dtype, device, kernels)
        self.self_attn = Attention(config, rotary, backend, dtype, device, kernels)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype, device, kernels)
        self.mlp = MLP(config, dtype, device, kernels)

    def forward(
        self,
        x: torch.Tensor,  # [N, hidden]: the previous layer's MLP output, or the embeddings
        residual: torch.Tensor | None,  # [N, hidden]: the residual stream before x is added
        rope: RopeStep,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (MLP output, residual stream before it)
        h, residual = self.input_layernorm.forward(x, residual)
        h = self.self_attn.forward(h, rope, kv_cache, attn_metadata)
        h, residual = self.post_attention_layernorm.forward(h, residual)
        return self.mlp.forward(h), residual


class LlamaModel(nn.Module):
    """Decoder stack plus LM head. Parameters are allocated empty; `load_weight` fills them.
    `kernels` (CPU float32 only) fuses the glue between matrix products."""

    def __init__(
        self,
        config: LlamaConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        kernels: CpuKernels | None = None,
    ) -> None:
        super().__init__()
        if kernels is not None and (dtype != torch.float32 or device.type != "cpu"):
            raise ValueError("CPU kernels need float32 on CPU")
        self.config = config
        self.kernels = kernels
        self.rotary = RotaryEmbedding(config, dtype, device)
        vocab, hidden = config.vocab_size, config.hidden_size
        self.lm_head = Linear(hidden, vocab, dtype=dtype, device=device)
        self.embed_tokens = (
            None
            if config.tie_word_embeddings
            else nn.Parameter(torch.empty(vocab, hidden, dtype=dtype, device=device), False)
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, self.rotary, backend, dtype, device, kernels)
            for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(hidden, config.rms_norm_eps, dtype, device, kernels)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[N] -> [N, hidden]."""
        if self.embed_tokens is None:
            return self.lm_head.embedding_rows(input_ids)
        return self.embed_tokens[input_ids]

    def forward(
        self,
        input_ids: torch.Tensor,  # [N]
        positions: torch.Tensor,  # [N]
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [N, hidden]: final-norm hidden states
        x = self.embed(input_ids)
        rope = self.rotary.prepare(positions, attn_metadata.max_position, self.kernels is None)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer.forward(x, residual, rope, kv_cache, attn_metadata)
        return self.norm.forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, hidden] final-norm states -> [M, vocab] logits."""
        return self.lm_head(hidden)

    def linears(self) -> list[Linear]:
        return [m for m in self.modules() if isinstance(m, Linear)]

    # -- weight loading -------------------------------------------------------------------

    def weight_targets(self) -> dict[str, WeightTarget]:
        """Every checkpoint tensor name (HF Llama naming) -> where it is loaded."""
        cfg = self.config
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

        def rows(dest: Linear, offset: int, num_rows: int) -> WeightTarget:
            return WeightTarget(dest, offset, (num_rows, dest.in_features))

        def whole(dest: torch.Tensor) -> WeightTarget:
            return WeightTarget(dest, 0, tuple(dest.shape))

        embed = self.embed_tokens
        targets = {
            "model.norm.weight": whole(self.norm.weight),
            "model.embed_tokens.weight": (
                rows(self.lm_head, 0, cfg.vocab_size) if embed is None else whole(embed)
            ),
        }
        if embed is not None:
            targets["lm_head.weight"] = rows(self.lm_head, 0, cfg.vocab_size)
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            p, attn, mlp = f"model.layers.{i}.", layer.self_attn, layer.mlp
            targets |= {
                p + "input_layernorm.weight": whole(layer.input_layernorm.weight),
                p + "post_attention_layernorm.weight": whole(layer.post_attention_layernorm.weight),
                p + "self_attn.q_proj.weight": rows(attn.qkv_proj, 0, q),
                p + "self_attn.k_proj.weight": rows(attn.qkv_proj, q, kv),
                p + "self_attn.v_proj.weight": rows(attn.qkv_proj, q + kv, kv),
                p + "self_attn.o_proj.weight": rows(attn.o_proj, 0, hidden),
                p + "mlp.gate_proj.weight": rows(mlp.gate_up_proj, 0, inter),
                p + "mlp.up_proj.weight": rows(mlp.gate_up_proj, inter, inter),
                p + "mlp.down_proj.weight": rows(mlp.down_proj, 0, hidden),
            }
        return targets
