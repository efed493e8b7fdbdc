"""A Llama decoder layer: attention and a gated MLP, each after an RMSNorm fused with the residual
add (`engine.models.llama` stacks them). `qkv_proj` and `gate_up_proj` each fuse several
projections into one matrix product: the output's columns are q, k, v by heads, and gate then up.
Every layer of a model is built from the same `DecoderParts`. With `kernels` (CPU float32), RoPE,
SiLU-and-mul and the norms run as fused C kernels; without them, as ATen ops. The layers of one
model write their small results to shared buffers (`DecoderBuffers`): each is used up within its
layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata, KVCache
from engine.kernels.buffers import DecoderBuffers, OutputBuffer
from engine.kernels.cpu import CpuKernels
from engine.layers.linear import Linear
from engine.layers.norm import RMSNorm
from engine.layers.quant_linear import QuantLinear
from engine.layers.rotary import RopeStep, RotaryEmbedding
from engine.models.config import LlamaConfig
from engine.parallel.shard import Shard, ShardLayout
from engine.quant.scheme import QuantScheme


@dataclass(frozen=True)
class DecoderParts:
    """What each decoder layer of one model is built from, the same for every layer."""

    config: LlamaConfig
    layout: ShardLayout  # this rank's share of heads and features
    shard: Shard
    rotary: RotaryEmbedding
    backend: AttentionBackend
    dtype: torch.dtype
    device: torch.device
    buffers: DecoderBuffers
    kernels: CpuKernels | None = None
    quant: QuantScheme | None = None  # how the layers' projections are quantized (None: not)

    def linear(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        output: OutputBuffer,
        gated: bool = False,
    ) -> Linear | QuantLinear:
        """One projection of a layer: a `QuantLinear` when the model is quantized."""
        dtype, device = self.dtype, self.device
        if self.quant is not None:
            return QuantLinear(
                in_features, out_features, bias, scheme=self.quant, dtype=dtype, device=device,
                gated=gated,
            )  # fmt: skip
        return Linear(
            in_features, out_features, bias, dtype=dtype, device=device, gated=gated,
            output=output,
        )  # fmt: skip


class Attention(nn.Module):
    def __init__(self, parts: DecoderParts) -> None:
        super().__init__()
        config, layout, buffers = parts.config, parts.layout, parts.buffers
        self.kernels = parts.kernels
        self.shard = parts.shard
        self.num_heads, self.num_kv_heads = layout.num_heads, layout.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        hidden = config.hidden_size
        self.qkv_proj = parts.linear(
            hidden, self.q_size + 2 * self.kv_size, config.qkv_bias, output=buffers.qkv
        )
        self.o_proj = parts.linear(self.q_size, hidden, config.o_proj_bias, output=buffers.o)
        self.rotary = parts.rotary
        self.backend = parts.backend

    def forward(
        self,
        x: torch.Tensor,  # [N, hidden]
        rope: RopeStep,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [N, hidden]
        n, q_size, kv_size = x.shape[0], self.q_size, self.kv_size
        qkv = self.qkv_proj.forward(x)  # [N, q_size + 2 * kv_size]
        self.o_proj.read_ahead()  # during RoPE and attention
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
        return self.shard.all_reduce_(self.o_proj.forward(out.reshape(n, self.q_size)))


class MLP(nn.Module):
    def __init__(self, parts: DecoderParts) -> None:
        super().__init__()
        buffers = parts.buffers
        self.kernels = parts.kernels
        self.shard = parts.shard
        self.intermediate_size = parts.layout.intermediate_size
        hidden = parts.config.hidden_size
        self.gate_up_proj = parts.linear(
            hidden, 2 * self.intermediate_size, output=buffers.gate_up, gated=True
        )
        self.down_proj = parts.linear(self.intermediate_size, hidden, output=buffers.down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            h = self.gate_up_proj.silu_and_mul(x)  # [N, intermediate], or None: not fused
            if h is None:
                gate_up = self.gate_up_proj.forward(x)
                self.down_proj.read_ahead()  # during SiLU-and-mul
                h = self.kernels.silu_and_mul(gate_up)
        else:
            gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)
            h = F.silu(gate) * up
        return self.shard.all_reduce_(self.down_proj.forward(h))


class DecoderLayer(nn.Module):
    def __init__(self, parts: DecoderParts) -> None:
        super().__init__()
        config, kernels, norm = parts.config, parts.kernels, parts.buffers.norm
        eps, hidden = config.rms_norm_eps, config.hidden_size
        dtype, device = parts.dtype, parts.device
        self.input_layernorm = RMSNorm(hidden, eps, dtype, device, kernels, norm)
        self.self_attn = Attention(parts)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype, device, kernels, norm)
        self.mlp = MLP(parts)

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
        self.mlp.gate_up_proj.read_ahead()  # during the norm
        h, residual = self.post_attention_layernorm.forward(h, residual)
        return self.mlp.forward(h), residual
