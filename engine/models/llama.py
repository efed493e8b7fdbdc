"""The Llama decoder (Llama-2/3, SmolLM2, and the Granite, Mistral and Qwen2 families, see
`engine.models.config`) over a paged KV cache.

The model takes one flat batch of new tokens from many sequences (prompt chunks, decode tokens,
draft-tree tokens) and explicit attention metadata; it never sees requests or sequences. Its
layers are `engine.models.decoder`'s.

With `kernels` (CPU float32), the glue between matrix products runs as fused C kernels
(`engine/kernels/cpu.py`): residual add + RMSNorm, RoPE in place, SiLU-and-mul (inside the
gate/up product where its kernel fuses it, `Linear.silu_and_mul`), and a tied embedding's
gather of rows. Without them it runs the same maths as ATen ops.

The families' constants are folded into the weights as they load (`weight_targets`), so that
their forward pass is Llama's: attention_multiplier * sqrt(head_dim) into q_proj (the backends
scale q.k by 1 / sqrt(head_dim); RoPE is linear), residual_multiplier into o_proj and down_proj,
embedding_multiplier into the embedding table and 1 / logits_scaling into the LM head. A tied
table holds embeddings / logits_scaling, and `embed` multiplies its rows by
embedding_multiplier * logits_scaling, the one multiplication a neutral config skips. The
final-norm hidden states a speculator drafts from are transformers' own.

With a `Shard` of N > 1 ranks, the model holds that rank's share (`engine.parallel.shard`) and
sums row-parallel outputs over the ranks; the checkpoint's tensors are read in slices.

The forward passes call submodules' `forward` directly, skipping `nn.Module.__call__`'s hook
dispatch on every call of a step: forward hooks on submodules do not run. Each module's
submodules are also plain instance attributes (`plain_submodules`), so that a step's reads of
them skip `nn.Module.__getattr__`.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import cast

import torch
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata, KVCache
from engine.kernels.buffers import DecoderBuffers
from engine.kernels.cpu import CpuKernels
from engine.layers.head_screen import HeadScreen
from engine.layers.linear import Linear
from engine.layers.norm import RMSNorm
from engine.layers.quant_linear import QuantLinear
from engine.layers.rotary import RotaryEmbedding
from engine.models.config import LlamaConfig
from engine.models.decoder import DecoderLayer, DecoderParts
from engine.models.loader import TensorSink, WeightTarget
from engine.parallel.shard import Shard, ShardLayout
from engine.quant.scheme import QuantScheme
from engine.quant.targets import gptq_targets, undeclared_head

__all__ = ["LlamaConfig", "LlamaModel"]


class LlamaModel(nn.Module):
    """Decoder stack plus LM head. Parameters are allocated empty; `load_weights` fills them
    (through `weight_targets`, which fold the family's constants in). `kernels` (CPU float32
    only) fuses the glue between matrix products. With `shard` of size N > 1, this is one rank's
    share (ValueError when N cannot split the model, see `engine.parallel.shard`): every rank
    runs `forward` on the same inputs together, and `compute_logits` returns the whole
    vocabulary's logits on rank 0 only. With `quant`, the decoder layers' projections are
    quantized (`engine.quant`), and the LM head where `quant.lm_head` says the checkpoint
    quantized it (each rank holding its vocabulary rows); the embeddings and norms stay in
    `dtype`."""

    def __init__(
        self,
        config: LlamaConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        kernels: CpuKernels | None = None,
        shard: Shard | None = None,
        quant: QuantScheme | None = None,
    ) -> None:
        super().__init__()
        if kernels is not None and (dtype != torch.float32 or device.type != "cpu"):
            raise ValueError("CPU kernels need float32 on CPU")
        self.config = config
        self.quant = quant
        self.kernels = kernels
        self.shard = shard = shard or Shard()
        self.layout = layout = ShardLayout.of(config, shard.rank, shard.size)
        self.rotary = RotaryEmbedding(config, dtype, device)
        vocab, hidden = layout.vocab_rows, config.hidden_size
        self.lm_head: Linear | QuantLinear = Linear(hidden, vocab, dtype=dtype, device=device)
        if quant is not None and quant.lm_head:  # this rank's real rows: none of the padding
            real = layout.vocab_end - layout.vocab_start
            self.lm_head = QuantLinear(hidden, real, scheme=quant, dtype=dtype, device=device)
        # A tied model's embedding rows are the float head's; a quantized head has its own.
        self.tied = config.tie_word_embeddings and isinstance(self.lm_head, Linear)
        self.embed_tokens = (
            None
            if self.tied
            else nn.Parameter(torch.zeros(vocab, hidden, dtype=dtype, device=device), False)
        )
        parts = DecoderParts(
            config, layout, shard, self.rotary, backend, dtype, device,
            DecoderBuffers(),  # results of small steps, written by each layer in turn
            kernels, quant,
        )  # fmt: skip
        self.layers = nn.ModuleList(DecoderLayer(parts) for _ in range(config.num_layers))
        self.norm = RMSNorm(hidden, config.rms_norm_eps, dtype, device, kernels)
        self.screen: HeadScreen | None = None  # `build_screen`
        tied_scale = config.embedding_multiplier * config.logits_scaling
        # What `embed` multiplies the tied table's rows by; None: nothing (untied, or neutral).
        self.embed_scale = tied_scale if self.tied and tied_scale != 1 else None
        for module in self.modules():
            plain_submodules(module)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[N] -> [N, hidden], times embedding_multiplier."""
        if self.shard.size == 1:
            return self._embed_rows(input_ids)
        layout = self.layout
        local = input_ids - layout.vocab_start
        inside = (local >= 0) & (local < layout.vocab_end - layout.vocab_start)  # [N]
        rows = self._embed_rows(torch.where(inside, local, 0))
        rows.mul_(inside.unsqueeze(1).to(rows.dtype))
        return self.shard.all_reduce_(rows)

    def _embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [N] of this rank's table -> [N, hidden] (a new tensor), times
        embedding_multiplier."""
        if self.embed_tokens is not None:
            return self.embed_tokens[ids]
        head = self.lm_head
        assert isinstance(head, Linear)  # tied: the head is the float table
        if self.kernels is not None and head.transposed:
            rows = self.kernels.gather_columns(head.storage, ids)
        else:
            rows = head.embedding_rows(ids)
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
            cast(DecoderLayer, layer).self_attn.qkv_proj.read_ahead()  # during the norm
            x, residual = layer.forward(x, residual, rope, kv_cache, attn_metadata)
        return self.norm.forward(x, residual)[0]

    def build_screen(self) -> None:
        """Make `screen`, an int8 screen of the LM head for argmax-only rows (`HeadScreen`),
        where it applies: a float32 head on CPU with the fused kernels, one rank. Called once
        the weights are loaded."""
        head, one_rank = self.lm_head, self.shard.size == 1
        if isinstance(head, Linear) and one_rank and head.out_features == self.config.vocab_size:
            self.screen = HeadScreen.build(head, self.kernels)

    def compute_logits(
        self,
        hidden: torch.Tensor,
        argmax_only: bool = False,
        maskable_ids: Collection[int] = (),
    ) -> torch.Tensor:
        """[M, hidden] final-norm states -> [M, vocab] logits (divided by logits_scaling); with
        several ranks, on rank 0 (the others get their [M, vocab_rows] share). `argmax_only`:
        the caller reads nothing but each row's argmax (first index on ties) after setting any
        of `maskable_ids` to -inf, so the rows may come from `screen`: exact at those ids and
        at the columns that may hold the maximum over the others, -inf elsewhere."""
        if argmax_only and self.screen is not None:
            screened = self.screen.logits(hidden, maskable_ids)
            if screened is not None:
                return screened
        logits = self.lm_head.forward(hidden)
        pad = self.layout.vocab_rows - logits.shape[1]  # a quantized head holds no pad rows
        if pad:
            logits = torch.nn.functional.pad(logits, (0, pad))
        return self.shard.gather_columns(logits, self.config.vocab_size)

    def linears(self) -> list[Linear]:
        return [m for m in self.modules() if isinstance(m, Linear)]

    # -- weight loading -------------------------------------------------------------------

    def weight_targets(self) -> dict[str, WeightTarget]:
        """Every checkpoint tensor name (HF Llama naming) -> where this rank loads its slice,
        and the constant it is multiplied by there (see the module's docstring)."""
        cfg, ly, rank = self.config, self.layout, self.shard.rank
        hidden, d = cfg.hidden_size, cfg.head_dim
        q_scale = 1.0
        if cfg.attention_multiplier is not None:
            q_scale = cfg.attention_multiplier * math.sqrt(cfg.head_dim)
        residual = cfg.residual_multiplier
        logits = 1.0 / cfg.logits_scaling
        q_rows = (ly.head_start * d, (ly.head_start + ly.num_heads) * d)
        kv_rows = (ly.kv_head_start * d, (ly.kv_head_start + ly.num_kv_heads) * d)
        mlp_rows = (ly.intermediate_start, ly.intermediate_start + ly.intermediate_size)
        vocab_rows = (ly.vocab_start, ly.vocab_end)
        q, kv, inter = q_rows[1] - q_rows[0], kv_rows[1] - kv_rows[0], ly.intermediate_size

        def rows(
            dest: TensorSink,
            offset: int,
            source: tuple[int, int],
            shape: tuple[int, int],
            scale: float = 1.0,
        ) -> WeightTarget:
            """Checkpoint rows `source` of a `shape` tensor -> dest's rows from `offset`."""
            return WeightTarget(dest, offset, shape, scale, source_rows=source)

        def columns(
            dest: TensorSink, source: tuple[int, int], shape: tuple[int, int]
        ) -> WeightTarget:
            """Checkpoint columns `source` of a `shape` tensor -> all of dest (row-parallel)."""
            return WeightTarget(dest, 0, shape, residual, source_cols=source)

        def whole(dest: torch.Tensor, scale: float = 1.0) -> WeightTarget:
            return WeightTarget(dest, 0, tuple(dest.shape), scale)

        def part(
            dest: torch.Tensor, source: tuple[int, int], size: int, scale: float = 1.0
        ) -> WeightTarget:
            """Elements `source` of a [size] checkpoint vector -> dest."""
            return WeightTarget(dest, 0, (size,), scale, source_rows=source)

        embed, vocab_shape = self.embed_tokens, (cfg.vocab_size, hidden)
        head = rows(self.lm_head, 0, vocab_rows, vocab_shape, logits)
        targets = {"model.norm.weight": whole(self.norm.weight), "model.embed_tokens.weight": head}
        if embed is not None:  # untied, or a quantized head (which gptq_targets expands)
            targets["lm_head.weight"] = head
            targets["model.embed_tokens.weight"] = WeightTarget(
                embed[: vocab_rows[1] - vocab_rows[0]],
                0,
                vocab_shape,
                cfg.embedding_multiplier,
                source_rows=vocab_rows,
            )
        q_all, kv_all = cfg.num_heads * d, cfg.num_kv_heads * d
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            p, attn, mlp = f"model.layers.{i}.", layer.self_attn, layer.mlp
            targets |= {
                p + "input_layernorm.weight": whole(layer.input_layernorm.weight),
                p + "post_attention_layernorm.weight": whole(layer.post_attention_layernorm.weight),
                p + "self_attn.q_proj.weight": rows(
                    attn.qkv_proj, 0, q_rows, (q_all, hidden), q_scale
                ),
                p + "self_attn.k_proj.weight": rows(attn.qkv_proj, q, kv_rows, (kv_all, hidden)),
                p + "self_attn.v_proj.weight": rows(
                    attn.qkv_proj, q + kv, kv_rows, (kv_all, hidden)
                ),
                p + "self_attn.o_proj.weight": columns(attn.o_proj, q_rows, (hidden, q_all)),
                p + "mlp.gate_proj.weight": rows(
                    mlp.gate_up_proj, 0, mlp_rows, (cfg.intermediate_size, hidden)
                ),
                p + "mlp.up_proj.weight": rows(
                    mlp.gate_up_proj, inter, mlp_rows, (cfg.intermediate_size, hidden)
                ),
                p + "mlp.down_proj.weight": columns(
                    mlp.down_proj, mlp_rows, (hidden, cfg.intermediate_size)
                ),
            }
            qkv_bias, o_bias = attn.qkv_proj.bias, attn.o_proj.bias
            if qkv_bias is not None:
                targets |= {
                    p + "self_attn.q_proj.bias": part(qkv_bias[:q], q_rows, q_all, q_scale),
                    p + "self_attn.k_proj.bias": part(qkv_bias[q : q + kv], kv_rows, kv_all),
                    p + "self_attn.v_proj.bias": part(qkv_bias[q + kv :], kv_rows, kv_all),
                }
            if o_bias is not None:  # added once: by rank 0, before the sum over ranks
                o_dest = o_bias if rank == 0 else None
                targets[p + "self_attn.o_proj.bias"] = WeightTarget(o_dest, 0, (hidden,), residual)
        if not (self.quant and self.quant.method == "gptq"):
            return targets
        if not self.quant.lm_head:
            targets |= undeclared_head(self.quant, cfg.vocab_size, hidden)
        return gptq_targets(targets)


def plain_submodules(module: nn.Module) -> None:
    """Keep each submodule of `module` in its instance dictionary too, where attribute reads
    find it without calling `nn.Module.__getattr__`. `nn.Module.__setattr__` removes the copy
    when the submodule is replaced (reads then take the slow path again)."""
    for name, child in module._modules.items():
        if child is not None:
            object.__setattr__(module, name, child)
