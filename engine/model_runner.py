"""Owns the model and its paged KV tensors; turns a scheduled batch into one forward pass."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path

import torch

from engine.attention import AttentionBackend, AttentionMetadata, KVCache, select_backend
from engine.config import EngineConfig
from engine.cuda_graphs import GraphSequence, StepGraphs
from engine.host_copy import to_device
from engine.host_memory import release_free_heap
from engine.kernels.cpu import check_cpu_bf16, load_cpu_kernels
from engine.kernels.plan_store import choose_kernels
from engine.kv_sizing import CudaMemory, DeviceMemory, MemoryGauge, kv_block_bytes, kv_pool_blocks
from engine.layers.quant_linear import QuantLinear
from engine.models.llama import LlamaConfig, LlamaModel
from engine.models.loader import load_weights
from engine.parallel.shard import Shard
from engine.quant.scheme import resolve_scheme
from engine.step_io import ModelOutput, SequenceInput

logger = logging.getLogger(__name__)


def resolve_dtype(dtype: str | None, config_dtype: str | None, device: str) -> torch.dtype:
    """An explicit dtype (one of `DTYPES`, as `EngineConfig` checks) wins; else float32 on CPU,
    and on CUDA the checkpoint's half type or float16."""
    if dtype is not None:
        return getattr(torch, dtype)
    if device.startswith("cuda"):
        return torch.bfloat16 if config_dtype == "bfloat16" else torch.float16
    return torch.float32


class ModelRunner:
    """Loads a model folder (a family `engine.models.config` supports), allocates the KV pool,
    executes steps. `max_model_len` is `config.max_model_len` (default: the model's max
    positions) capped at the model's sliding window, if any. The decoder layers' projections
    are quantized as `config.quantization` and the checkpoint declare (`resolve_scheme`, which
    raises CheckpointError where they disagree).

    On CPU in float32 the model's glue and attention run as fused C kernels unless
    `config.cpu_kernels` is false (or no C compiler is found); the results are the same within
    float32 rounding. The pool holds `config.num_kv_blocks` blocks, else enough for
    `config.kv_cache_tokens` tokens, else as many as `config.kv_cache_memory_mb` holds, else on
    CUDA what `engine.kv_sizing` leaves after a profiled worst-case step (512 MiB on CPU). A
    `memory` gauge, when given, applies that device rule on any device with its figures
    (default: `CudaMemory` on CUDA, none on CPU).

    With `config.cuda_graphs` and the Triton backend, steps of decode rows and draft trees run
    as `StepGraphs` (captured on CUDA; elsewhere, as in tests, the same static-buffer step runs
    eagerly); the pool then holds one block more than `num_blocks`, the graphs' pad block.

    With a `shard` of N > 1 ranks, this runner holds that rank's share of the model and of
    every KV block (`engine.parallel.shard`; the pool has as many blocks on every rank), runs
    on `cuda:<rank>` when `config.device` is CUDA, and without CUDA graphs; every rank must
    call `execute` with the same inputs together, and only rank 0's logits are the model's.
    Every rank runs its profile step during construction, together with the others.
    """

    def __init__(
        self, config: EngineConfig, shard: Shard | None = None, memory: MemoryGauge | None = None
    ) -> None:
        self.model_path = Path(config.model_path)
        self.config = LlamaConfig.from_folder(self.model_path)
        self.shard = shard = shard or Shard()
        self.max_model_len = self._max_model_len(config.max_model_len)
        device = torch.device(config.device)
        if shard.size > 1 and device.type == "cuda":
            device = torch.device("cuda", shard.rank)
        self.device = device
        if memory is None and device.type == "cuda":
            memory = CudaMemory(device)
        self.memory = memory
        self.dtype = resolve_dtype(config.dtype, self.config.torch_dtype, config.device)
        if self.device.type == "cpu" and self.dtype == torch.bfloat16:
            check_cpu_bf16()
        fused = config.cpu_kernels and self.device.type == "cpu" and self.dtype == torch.float32
        kernels = load_cpu_kernels() if fused else None
        self.backend: AttentionBackend = select_backend(
            config.device, config.block_size, kernels, self.dtype, config.flash_attention
        )
        self.block_size = self.backend.block_size
        self.quant = resolve_scheme(config.quantization, self.model_path)
        self.model = LlamaModel(
            self.config, self.backend, self.dtype, self.device, kernels, shard, self.quant
        )
        load_weights(self.model, self.model_path)
        self.model.eval()
        for module in self.model.modules():  # the kernels' copies become the only ones
            if isinstance(module, QuantLinear):
                module.build_kernel()
        if self.device.type == "cpu":
            self.model.build_screen()
            self.kernel_table = choose_kernels(self.model.linears(), config.kernel_plan)
            logger.info(
                "linear kernels by [in, out] and rows: %s",
                ", ".join(
                    f"{k}x{n} " + " ".join(f"{m}:{name}" for m, name in sorted(plan.items()))
                    for (k, n), plan in self.kernel_table.chosen.items()
                ),
            )
            release_free_heap()  # the loading's temporaries
        self.kv_caches: list[KVCache] = []
        self._kv_pool = torch.empty(0)
        self.graphs: StepGraphs | None = None
        shard.barrier()  # ranks load at different speeds; the profile step needs them all
        self.num_blocks, self.kv_pool_source = self._num_kv_blocks(config)
        graphs = config.cuda_graphs and self.backend.name == "triton" and shard.size == 1
        self.kv_caches = self._allocate_kv_caches(self.num_blocks + graphs)
        if self.backend.name in ("triton", "flash-attn"):  # no step compiles after this
            try:
                from engine.attention.triton_backend import warm_up
            except ImportError:
                pass  # flash-attn's backend without triton: nothing to compile
            else:
                warm_up(self.backend, self.kv_caches, self.model.layout.num_heads)
        if self.device.type == "cuda":  # the quantized layers' Triton kernels, likewise
            for module in self.model.modules():
                if isinstance(module, QuantLinear):
                    module.warm_up(config.max_num_batched_tokens)
        if graphs:
            from engine.attention.triton_backend import TritonBackend

            assert isinstance(self.backend, TritonBackend)
            self.graphs = StepGraphs(
                self.model,
                self.kv_caches,
                self.backend,
                min(config.cuda_graph_max_rows, config.max_num_batched_tokens),
                max_blocks_per_seq=math.ceil(self.max_model_len / self.block_size),
                pad_block=self.num_blocks,
                max_position=self.max_model_len - 1,
            )
            self.graphs.capture()
        logger.info(
            "loaded %s (%s%s, %s, attention %s, %d KV blocks of %d from %s)",
            self.model_path.name,
            self.dtype,
            "" if self.quant is None else f", quantization {self.quant.describe()}",
            self.device,
            self.backend.name,
            self.num_blocks,
            self.block_size,
            self.kv_pool_source,
        )

    def _max_model_len(self, requested: int | None) -> int:
        """`LlamaConfig.max_model_len`, logged when the sliding window caps it."""
        length = self.config.max_model_len(requested)
        wanted = requested or self.config.max_position_embeddings
        if length < wanted:
            logger.warning(
                "max_model_len %d capped at %d, the %s model's sliding_window: attention over a "
                "window is not implemented, so requests stay within it",
                wanted,
                length,
                self.config.model_type,
            )
        return length

    def _allocate_kv_caches(self, num_blocks: int) -> list[KVCache]:
        """Every layer's (key, value) cache: contiguous views of one pool tensor, so that a
        copy between slots moves them in all layers at once (`copy_slots`)."""
        layout = self.model.layout
        shape = (self.config.num_layers, 2, num_blocks, self.block_size, layout.num_kv_heads)
        self._kv_pool = torch.zeros(
            (*shape, self.config.head_dim), dtype=self.dtype, device=self.device
        )  # [layers, 2, blocks, block_size, kv_heads, head_dim]
        return [(layer[0], layer[1]) for layer in self._kv_pool]

    def _kv_slots(self) -> torch.Tensor:  # [layers * 2, slots, kv_heads, head_dim], a view
        pool = self._kv_pool
        return pool.view(pool.shape[0] * 2, -1, *pool.shape[4:])

    def _block_bytes(self) -> int:
        return kv_block_bytes(
            self.config, self.block_size, self.dtype, self.model.layout.num_kv_heads
        )

    def _num_kv_blocks(self, config: EngineConfig) -> tuple[int, str]:
        """The pool's size in blocks (the smallest any rank can hold), and what set it (see
        `engine.kv_sizing`)."""
        num_blocks, source = kv_pool_blocks(
            config,
            self._block_bytes(),
            self.block_size,
            lambda: self.profile_memory(config.max_num_batched_tokens),
            on_cuda=self.memory is not None,
        )
        smallest = self.shard.min(num_blocks)
        if smallest < num_blocks:
            source += f"; {num_blocks} here, fewer on another rank: every rank takes the smallest"
        return smallest, source

    def profile_memory(self, num_tokens: int) -> DeviceMemory:
        """Run one worst-case step (one sequence of `num_tokens` new tokens, logits for every
        row, as many as a step of draft trees can have) on a scratch KV pool, and measure the
        device's memory with the runner's gauge: the peak excludes the scratch pool. The step
        is this rank's forward pass alone (never a group step's message): every rank of a
        tensor-parallel group profiles at the same point of its construction, so their
        collectives meet."""
        assert self.memory is not None
        num_blocks = math.ceil(num_tokens / self.block_size)
        scratch_bytes = num_blocks * self._block_bytes()
        self.memory.reset_peak()
        self.kv_caches = self._allocate_kv_caches(num_blocks)
        step = SequenceInput(
            token_ids=[0] * num_tokens,
            num_computed_tokens=0,
            block_table=list(range(num_blocks)),
            logits_indices=list(range(num_tokens)),
        )
        ModelRunner.execute(self, [step])
        peak = self.memory.peak_allocated() - scratch_bytes
        self.kv_caches, self._kv_pool = [], torch.empty(0)
        total, non_torch = self.memory.totals()
        return DeviceMemory(total=total, peak_allocated=peak, non_torch=non_torch)

    def _to_device(self, *arrays: list[int]) -> list[torch.Tensor]:
        """The int lists as int64 views of one device tensor, made by one host-to-device copy
        (from pinned memory and asynchronous on CUDA)."""
        flat = to_device(
            torch.tensor([x for a in arrays for x in a], dtype=torch.int64), self.device
        )
        views = []
        start = 0
        for a in arrays:
            views.append(flat[start : start + len(a)])
            start += len(a)
        return views

    def rows_index(self, rows: list[int]) -> slice | torch.Tensor:
        """An index of `rows` of a step's outputs: a slice (views, no copy) when they are
        consecutive, else an int64 tensor on the device (`_to_device`)."""
        if rows and rows == list(range(rows[0], rows[0] + len(rows))):
            return slice(rows[0], rows[0] + len(rows))
        return self._to_device(rows)[0]

    def _graph_step(self, seqs: list[SequenceInput]) -> list[GraphSequence] | None:
        """The step as the graphs take it, or None when they do not cover it: every sequence
        feeds one token at its next position or a draft tree, with logits for every row and no
        prompt-prefix embeddings (see `StepGraphs.covers`)."""
        graph_seqs = []
        for s in seqs:
            n, start = len(s.token_ids), s.num_computed_tokens
            if (n > 1 and s.tree_mask is None) or s.prefix_embeds is not None:
                return None  # a prefill chunk, or prompt-tuning embeddings
            if s.logits_indices != list(range(n)) and not (n == 1 and s.logits_indices is None):
                return None
            positions = s.positions if s.positions is not None else list(range(start, start + n))
            slots = self.slot_mapping(s.block_table, start, start + n)
            graph_seqs.append(
                GraphSequence(s.token_ids, positions, slots, start + n, s.block_table, s.tree_mask)
            )
        assert self.graphs is not None
        return graph_seqs if self.graphs.covers(graph_seqs) else None

    def slot_mapping(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy the K/V of cache slots `src[i]` to `dst[i]` in every layer (accepted draft
        nodes to their sequence positions). All reads happen before any write."""
        if not src:
            return
        src_index, dst_index = self._to_device(src, dst)
        slots = self._kv_slots()
        slots.index_copy_(1, dst_index, slots.index_select(1, src_index))

    def read_kv(self, slots: list[int]) -> list[torch.Tensor]:
        """The K/V each rank holds at cache `slots`: one [num_layers, 2, len(slots),
        rank's KV heads, head_dim] tensor per rank (one here)."""
        index = self._to_device(slots)[0]
        return [self._kv_at(index)]

    def _kv_at(self, index: torch.Tensor) -> torch.Tensor:
        layers = self.config.num_layers
        return self._kv_slots().index_select(1, index).unflatten(0, (layers, 2))

    def close(self) -> None:
        """Stop what the runner started (another rank's processes); idempotent."""

    def watch(self, on_failure: Callable[[str], None]) -> None:
        """Have `on_failure(message)` called once (from any thread) if the runner breaks for
        good: a tensor-parallel rank failed. Never called for one process."""

    @torch.inference_mode()
    def execute(self, seqs: list[SequenceInput]) -> ModelOutput:
        """Run one forward pass over every sequence's new tokens."""
        graph_seqs = self._graph_step(seqs) if self.graphs is not None else None
        if graph_seqs is not None:
            assert self.graphs is not None
            logits, hidden = self.graphs.run(graph_seqs)
            return ModelOutput(logits, hidden, num_rows=[len(s.token_ids) for s in seqs])
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        num_rows: list[int] = []
        embed_rows: list[int] = []
        embeds: list[torch.Tensor] = []
        for seq in seqs:
            n, start = len(seq.token_ids), seq.num_computed_tokens
            offset = len(input_ids)
            if seq.prefix_embeds is not None:
                embed_rows += range(offset, offset + len(seq.prefix_embeds))
                embeds.append(seq.prefix_embeds)
            input_ids += seq.token_ids
            positions += seq.positions if seq.positions is not None else range(start, start + n)
            slots += self.slot_mapping(seq.block_table, start, start + n)
            picked = seq.logits_indices if seq.logits_indices is not None else [n - 1]
            rows += [offset + j for j in picked]
            num_rows.append(len(picked))
        max_blocks = max(len(s.block_table) for s in seqs)
        block_tables = [
            b for s in seqs for b in s.block_table + [0] * (max_blocks - len(s.block_table))
        ]
        all_rows = len(rows) == len(input_ids) and rows == list(range(len(rows)))
        ids_d, positions_d, slots_d, tables_d, rows_d, embed_rows_d = self._to_device(
            input_ids, positions, slots, block_tables, [] if all_rows else rows, embed_rows
        )
        metadata = AttentionMetadata(
            slot_mapping=slots_d,
            query_lens=[len(s.token_ids) for s in seqs],
            seq_lens=[s.num_computed_tokens + len(s.token_ids) for s in seqs],
            block_tables=tables_d.view(len(seqs), max_blocks).int(),
            max_position=max(positions),
            tree_masks=[s.tree_mask for s in seqs],
        )
        self.backend.prepare(metadata)
        inputs_embeds = None
        if embeds:
            inputs_embeds = self.model.embed(ids_d)  # [N, hidden]
            overrides = self.model.scale_input_embeds(torch.cat(embeds))  # [K, hidden]
            overrides = overrides.to(inputs_embeds.device, inputs_embeds.dtype)
            inputs_embeds.index_copy_(0, embed_rows_d, overrides)
        hidden = self.model(ids_d, positions_d, self.kv_caches, metadata, inputs_embeds)
        if not all_rows:
            hidden = hidden.index_select(0, rows_d)
        maskable_ids = frozenset().union(*(s.maskable_ids for s in seqs))
        logits = self.model.compute_logits(hidden, all(s.argmax_only for s in seqs), maskable_ids)
        logits = logits.float()
        return ModelOutput(logits=logits, hidden_states=hidden, num_rows=num_rows)
