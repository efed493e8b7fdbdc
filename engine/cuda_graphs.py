"""CUDA graphs of decode steps: one launch replays a whole forward pass.

A decode step (every sequence feeds one token, no draft tree, logits for every row) of a batch of
b sequences runs as the graph captured for the smallest bucket B >= b. The step's inputs go into
static buffers that the graph reads: one [B, 4 + max_blocks] int32 matrix on the device whose
row i holds sequence i's token id, position, cache slot, length and block table, filled by one
host-to-device copy. Rows b..B-1 are padding: token 0 at position 0, written to a pad block the
KV manager never hands out (`ModelRunner` allocates one block more than it reports), attending
to that block alone. The graph's logits and hidden states are static outputs, valid until the
next replay; rows of a batch do not interact, so padding changes no real row.

Graphs are captured at start-up, largest bucket first, into one shared memory pool, after a
warm-up run of each (Triton compiles its kernel then). Off CUDA the same static-buffer step runs
eagerly instead of replaying: that is how CPU tests check the buffers, the padding and the pad
block against the ordinary eager path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.attention.backend import KVCache

if TYPE_CHECKING:
    from engine.attention.triton_backend import TritonBackend
    from engine.models.llama import LlamaModel

logger = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
"""Buckets captured, up to the engine's max_num_seqs; larger decode batches run eagerly."""

_FIELDS = 4  # token id, position, slot, sequence length; then the block table


@dataclass
class DecodeRow:
    """One sequence's share of a decode step."""

    token_id: int
    position: int
    slot: int
    block_table: list[int]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None off CUDA: the step runs eagerly
    logits: torch.Tensor  # [B, vocab] float32
    hidden_states: torch.Tensor  # [B, hidden]


class DecodeGraphs:
    """Decode steps at bucketed batch sizes as CUDA graphs over static input buffers."""

    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[KVCache],
        backend: TritonBackend,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        pad_block: int,
        max_position: int,
    ) -> None:
        """`pad_block`: a cache block no sequence owns, written by padding rows;
        `max_position`: the largest RoPE position a step may hold (the model's table is grown
        to it before capture, so no replay needs to grow it)."""
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.device = kv_caches[0][0].device
        self.batch_sizes = [b for b in BATCH_SIZES if b <= max_num_seqs] or [max_num_seqs]
        self.max_batch_size = self.batch_sizes[-1]
        self.max_blocks_per_seq = max_blocks_per_seq
        self.pad_block = pad_block
        self.max_position = max_position
        block_size = kv_caches[0][0].shape[1]
        self.pad_row = [0, 0, pad_block * block_size, 1, pad_block]
        b = self.max_batch_size
        self.inputs = torch.zeros(  # [B, 4 + max_blocks]: see the module docstring
            b, _FIELDS + max_blocks_per_seq, dtype=torch.int32, device=self.device
        )
        self.inputs[:, 2] = pad_block * block_size
        self.inputs[:, 3] = 1
        self.inputs[:, 4] = pad_block
        self.cu_q = torch.arange(b + 1, dtype=torch.int32, device=self.device)  # [B + 1]
        self.mask_offsets = torch.full((b,), -1, dtype=torch.int32, device=self.device)  # [B]
        self.masks = torch.zeros(1, dtype=torch.uint8, device=self.device)
        self.graphs: dict[int, _Graph] = {}

    def capture(self) -> None:
        """Capture every bucket (on CUDA; elsewhere record eager steps)."""
        start = time.perf_counter()
        self.model.rotary.reserve(self.max_position)
        if self.device.type != "cuda":
            for b in self.batch_sizes:
                self.graphs[b] = _Graph(None, *self._forward(b))
            return
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.batch_sizes):
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._forward(b)  # warm-up: Triton compiles, the allocator settles
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits, hidden = self._forward(b)
            self.graphs[b] = _Graph(graph, logits, hidden)
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured CUDA graphs of decode steps at batch sizes %s in %.1f s",
            ",".join(map(str, self.batch_sizes)),
            time.perf_counter() - start,
        )

    def bucket(self, num_seqs: int) -> int | None:
        """The captured batch size a decode step of `num_seqs` sequences runs at; None when it
        is larger than every bucket."""
        return next((b for b in self.batch_sizes if b >= num_seqs), None)

    @torch.inference_mode()
    def run(self, rows: Sequence[DecodeRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step: ([b, vocab] float32 logits, [b, hidden] final-norm states), views
        of the graph's static outputs, valid until the next `run`. Needs b <= max_batch_size
        and each block table within `max_blocks_per_seq` blocks."""
        b = len(rows)
        bucket = self.bucket(b)
        assert bucket is not None, f"{b} sequences exceed the largest graph ({self.max_batch_size})"
        width = _FIELDS + max(len(r.block_table) for r in rows)
        pad = self.pad_row + [0] * (width - len(self.pad_row))
        host = torch.tensor(
            [
                [r.token_id, r.position, r.slot, r.position + 1, *r.block_table]
                + [0] * (width - _FIELDS - len(r.block_table))
                for r in rows
            ]
            + [pad] * (bucket - b),
            dtype=torch.int32,
        )  # [bucket, width]
        if self.device.type == "cuda":
            host = host.pin_memory()
        self.inputs[:bucket, :width].copy_(host, non_blocking=True)
        graph = self.graphs[bucket]
        if graph.graph is None:
            logits, hidden = self._forward(bucket)
        else:
            graph.graph.replay()
            logits, hidden = graph.logits, graph.hidden_states
        return logits[:b], hidden[:b]

    def _forward(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step of the first `b` rows of the static inputs, as captured."""
        rows = self.inputs[:b]
        metadata = self.backend.static_metadata(
            slot_mapping=rows[:, 2].long(),
            block_tables=rows[:, _FIELDS:],
            cu_q=self.cu_q[: b + 1],
            seq_lens=rows[:, 3].contiguous(),
            mask_offsets=self.mask_offsets[:b],
            masks=self.masks,
            max_position=self.max_position,
        )
        hidden = self.model(rows[:, 0].long(), rows[:, 1].long(), self.kv_caches, metadata)
        return self.model.compute_logits(hidden).float(), hidden
