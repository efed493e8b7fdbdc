"""The Llama decoder (Llama-2/3, SmolLM2, and the Granite, Mistral and Qwen2 families, see
`engine.models.config`) over a paged KV cache.

The model takes one flat batch of new tokens from many sequences (prompt chunks, decode tokens,
draft-tree tokens) and explicit attention metadata; it never sees requests or sequences.
`qkv_proj` and `gate_up_proj` each fuse several projections into one matrix product: the output's
columns are q, k, v by heads, and gate then up.

With `kernels` (CPU float32), the glue between matrix products runs as fused C kernels
(`engine/kernels/cpu.py`): residual add + RMSNorm, RoPE in place, SiLU-and-mul. Without them it runs
the same maths as ATen ops.

The families' constants are folded into the weights as they load (`weight_targets`), so that
their forward pass is Llama's: attention_multiplier * sqrt(head_dim) into q_proj (the backends
scale q.k by 1 / sqrt(head_dim); RoPE is linear), residual_multiplier into o_proj and down_proj,
embedding_multiplier into the embedding table and 1 / logits_scaling into the LM head. A tied
table holds embeddings / logits_scaling, and `embed` multiplies its rows by
embedding_multiplier * logits_scaling, the one multiplication a neutral config skips. The
final-norm hidden states a speculator drafts from are transformers' own.

The forward passes call submodules' `forward` directly, skipping `nn.Module.__call__`'s hook
dispatch on every call of a step: forward hooks on submodules do not run.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata, KVCache
from engine.kernels.cpu import CpuKernels
from engine.layers.linear import Linear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RopeStep, RotaryEmbedding
from engine.models.config import LlamaConfig
from engine.models.loader import WeightTarget

__all__ = ["LlamaConfig", "LlamaModel"]


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
        self.qkv_proj = Linear(
            hidden, self.q_size + 2 * self.kv_size, config.qkv_bias, dtype=dtype, device=device
        )
        self.o_proj = Linear(self.q_size, hidden, config.o_proj_bias, dtype=dtype, device=device)
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
    """Decoder stack plus LM head. Parameters are allocated empty; `load_weights` fills them
    (through `weight_targets`, which fold the family's constants in). `kernels` (CPU float32
    only) fuses the glue between matrix products."""

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
        tied_scale = config.embedding_multiplier * config.logits_scaling
        # What `embed` multiplies the tied table's rows by; None: nothing (untied, or neutral).
        self.embed_scale = tied_scale if config.tie_word_embeddings and tied_scale != 1 else None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[N] -> [N, hidden], times embedding_multiplier."""
        if self.embed_tokens is not None:
            return self.embed_tokens[input_ids]
        rows = self.lm_head.embedding_rows(input_ids)
        return rows if self.embed_scale is None else rows.mul_(self.embed_scale)

    def scale_input_embeds(self, embeds: torch.Tensor) -> torch.Tensor:
        """[K, hidden] input embeddings as transformers' `inputs_embeds` (rows of the input
        embedding table's space) -> what `embed` returns for such rows: times
        embedding_multiplier."""
        multiplier = self.config.embedding_multiplier
        return embeds if multiplier == 1 else embeds * multiplier

    def forward(
        self,
        input_ids: torch.Tensor,  # [N]
        positions: torch.Tensor,  # [N]
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [N, hidden]: replaces embed(input_ids)
    ) -> torch.Tensor:  # [N, hidden]: final-norm hidden states
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rotary.prepare(positions, attn_metadata.max_position, self.kernels is None)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer.forward(x, residual, rope, kv_cache, attn_metadata)
        return self.norm.forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, hidden] final-norm states -> [M, vocab] logits (divided by logits_scaling)."""
        return self.lm_head(hidden)

    def linears(self) -> list[Linear]:
        return [m for m in self.modules() if isinstance(m, Linear)]

    # -- weight loading -------------------------------------------------------------------

    def weight_targets(self) -> dict[str, WeightTarget]:
        """Every checkpoint tensor name (HF Llama naming) -> where it is loaded, and the constant
        it is multiplied by there (see the module's docstring)."""
        cfg = self.config
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q_scale = 1.0
        if cfg.attention_multiplier is not None:
            q_scale = cfg.attention_multiplier * math.sqrt(cfg.head_dim)
        residual = cfg.residual_multiplier
        logits = 1.0 / cfg.logits_scaling

        def rows(dest: Linear, offset: int, num_rows: int, scale: float = 1.0) -> WeightTarget:
            return WeightTarget(dest, offset, (num_rows, dest.in_features), scale)

        def whole(dest: torch.Tensor, scale: float = 1.0) -> WeightTarget:
            return WeightTarget(dest, 0, tuple(dest.shape), scale)

        embed = self.embed_tokens
        targets = {
            "model.norm.weight": whole(self.norm.weight),
            "model.embed_tokens.weight": (
                rows(self.lm_head, 0, cfg.vocab_size, logits)
                if embed is None
                else whole(embed, cfg.embedding_multiplier)
            ),
        }
        if embed is not None:
            targets["lm_head.weight"] = rows(self.lm_head, 0, cfg.vocab_size, logits)
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            p, attn, mlp = f"model.layers.{i}.", layer.self_attn, layer.mlp
            targets |= {
                p + "input_layernorm.weight": whole(layer.input_layernorm.weight),
                p + "post_attention_layernorm.weight": whole(layer.post_attention_layernorm.weight),
                p + "self_attn.q_proj.weight": rows(attn.qkv_proj, 0, q, q_scale),
                p + "self_attn.k_proj.weight": rows(attn.qkv_proj, q, kv),
                p + "self_attn.v_proj.weight": rows(attn.qkv_proj, q + kv, kv),
                p + "self_attn.o_proj.weight": rows(attn.o_proj, 0, hidden, residual),
                p + "mlp.gate_proj.weight": rows(mlp.gate_up_proj, 0, inter),
                p + "mlp.up_proj.weight": rows(mlp.gate_up_proj, inter, inter),
                p + "mlp.down_proj.weight": rows(mlp.down_proj, 0, hidden, residual),
            }
            qkv_bias, o_bias = attn.qkv_proj.bias, attn.o_proj.bias
            if qkv_bias is not None:
                targets |= {
                    p + "self_attn.q_proj.bias": whole(qkv_bias[:q], q_scale),
                    p + "self_attn.k_proj.bias": whole(qkv_bias[q : q + kv]),
                    p + "self_attn.v_proj.bias": whole(qkv_bias[q + kv :]),
                }
            if o_bias is not None:
                targets[p + "self_attn.o_proj.bias"] = whole(o_bias, residual)
        return targets
