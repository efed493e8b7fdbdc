"""CUDA graphs of steps: one launch replays a whole forward pass.

A step whose every sequence either decodes one token or verifies a draft tree (of at most
`MAX_TREE_ROWS` rows), with logits for every row, runs as the graph captured for the smallest
row count R >= its rows. A speculative step is then as cheap to launch as a decode step: at batch
1 a tree of n nodes runs as the graph of the next bucket above n.

Each graph reads one static int32 buffer on the device, filled by one host-to-device copy:

    tokens [R] | positions [R] | slots [R] | seq_lens [R] | cu_q [R + 1] | mask_offsets [R]
    | block_tables [R, max_blocks] | tree masks, as bytes [R * MAX_TREE_ROWS]

The graph has R sequence slots: the step's sequences first, then one padding sequence per
remaining row (token 0 at position 0, written to a pad block the KV manager never hands out:
`ModelRunner` allocates one block more than it reports, and attending to that block alone), then
empty sequences (no rows) when the real ones hold several rows each. Rows of different sequences
do not interact, so padding changes no real row. Tree masks are row-major [q, q] bytes at
`mask_offsets` (byte offsets into the whole buffer; -1 for one decode row), as the Triton kernel
reads them. The graph's logits and hidden states are static outputs, valid until the next replay.

Graphs are captured at start-up, largest first, into one shared memory pool, after a warm-up run
of each (the allocator settles; the backend's `warm_up` compiled the kernels before). Off CUDA
the same static-buffer step runs eagerly instead of replaying: that is how CPU tests check the
buffer, the padding and the pad block against the ordinary eager path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.attention.backend import KVCache

if TYPE_CHECKING:
    from engine.attention.triton_backend import TritonBackend
    from engine.models.llama import LlamaModel

logger = logging.getLogger(__name__)

ROW_COUNTS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
"""Row counts captured, up to the engine's `cuda_graph_max_rows`; larger steps run eagerly."""

MAX_TREE_ROWS = 64
"""The most rows (root and drafts) one sequence's draft tree may have in a graph step."""


@dataclass
class GraphSequence:
    """One sequence's share of a graph step: its new tokens (one, or a draft tree's nodes), their
    RoPE positions and cache slots, its length after the step, its block table, and its tree
    mask ([q, q] bool, None for one decode token)."""

    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    seq_len: int
    block_table: list[int]
    tree_mask: torch.Tensor | None = None


class _Layout:
    """Offsets (in int32 elements) of the fields of a graph of `rows` rows in its buffer."""

    def __init__(self, rows: int, max_blocks: int) -> None:
        self.rows, self.max_blocks = rows, max_blocks
        self.seq_lens = 3 * rows
        self.cu_q = self.seq_lens + rows
        self.mask_offsets = self.cu_q + rows + 1
        self.block_tables = self.mask_offsets + rows
        self.masks = self.block_tables + rows * max_blocks
        self.size = self.masks + (rows * MAX_TREE_ROWS + 3) // 4


@dataclass
class _Graph:
    layout: _Layout
    template: np.ndarray  # [size] int32: every row a padding sequence
    buffer: torch.Tensor  # [size] int32 on the device: what the graph reads
    graph: torch.cuda.CUDAGraph | None = None  # None off CUDA: the step runs eagerly
    logits: torch.Tensor | None = None  # [R, vocab] float32
    hidden_states: torch.Tensor | None = None  # [R, hidden]


class StepGraphs:
    """Decode and draft-tree steps at bucketed row counts as CUDA graphs over static buffers."""

    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[KVCache],
        backend: TritonBackend,
        max_num_rows: int,
        max_blocks_per_seq: int,
        pad_block: int,
        max_position: int,
    ) -> None:
        """`max_num_rows`: the largest bucket; `pad_block`: a cache block no sequence owns,
        written by padding rows; `max_position`: the largest RoPE position a step may hold (the
        model's table is grown to it before capture, so no replay needs to grow it)."""
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.device = kv_caches[0][0].device
        self.row_counts = [r for r in ROW_COUNTS if r <= max_num_rows] or [max(1, max_num_rows)]
        self.max_num_rows = self.row_counts[-1]
        self.max_blocks_per_seq = max_blocks_per_seq
        self.pad_block = pad_block
        self.max_position = max_position
        self.block_size = kv_caches[0][0].shape[1]
        self.graphs = {r: self._new_graph(r) for r in self.row_counts}

    def _new_graph(self, rows: int) -> _Graph:
        layout = _Layout(rows, self.max_blocks_per_seq)
        host = np.zeros(layout.size, dtype=np.int32)
        host[2 * rows : 3 * rows] = self.pad_block * self.block_size  # slots
        host[layout.seq_lens : layout.seq_lens + rows] = 1
        host[layout.cu_q : layout.cu_q + rows + 1] = np.arange(rows + 1)
        host[layout.mask_offsets : layout.mask_offsets + rows] = -1
        tables = host[layout.block_tables : layout.masks].reshape(rows, self.max_blocks_per_seq)
        tables[:, 0] = self.pad_block
        buffer = torch.from_numpy(host).to(self.device)
        return _Graph(layout, host, buffer)

    def capture(self) -> None:
        """Capture every bucket (on CUDA; elsewhere nothing to do: steps run eagerly)."""
        self.model.rotary.reserve(self.max_position)
        if self.device.type != "cuda":
            return
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for rows in reversed(self.row_counts):
            g = self.graphs[rows]
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._forward(g)  # warm-up: the allocator settles
            torch.cuda.current_stream(self.device).wait_stream(side)
            g.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g.graph, pool=pool):
                g.logits, g.hidden_states = self._forward(g)
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured CUDA graphs of decode and draft-tree steps of %s rows in %.1f s",
            ",".join(map(str, self.row_counts)),
            time.perf_counter() - start,
        )

    def bucket(self, num_rows: int) -> int | None:
        """The captured row count a step of `num_rows` rows runs at; None when it is larger
        than every bucket."""
        return next((r for r in self.row_counts if r >= num_rows), None)

    def covers(self, seqs: Sequence[GraphSequence]) -> bool:
        """Whether the graphs can run this step: few enough rows, one row or a tree of at most
        `MAX_TREE_ROWS` per sequence, block tables within `max_blocks_per_seq`."""
        return sum(len(s.token_ids) for s in seqs) <= self.max_num_rows and all(
            (len(s.token_ids) == 1 or s.tree_mask is not None)
            and len(s.token_ids) <= MAX_TREE_ROWS
            and len(s.block_table) <= self.max_blocks_per_seq
            for s in seqs
        )

    @torch.inference_mode()
    def run(self, seqs: Sequence[GraphSequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """One step (`covers(seqs)` must hold): ([n, vocab] float32 logits, [n, hidden]
        final-norm states) for its n rows in order, views of the graph's static outputs, valid
        until the next `run`."""
        num_rows = sum(len(s.token_ids) for s in seqs)
        bucket = self.bucket(num_rows)
        assert bucket is not None, f"{num_rows} rows exceed the largest graph ({bucket})"
        g = self.graphs[bucket]
        host = torch.from_numpy(self._fill(g, seqs))
        if self.device.type == "cuda":
            host = host.pin_memory()
        g.buffer.copy_(host, non_blocking=True)
        if g.graph is None:
            logits, hidden = self._forward(g)
        else:
            g.graph.replay()
            assert g.logits is not None and g.hidden_states is not None
            logits, hidden = g.logits, g.hidden_states
        return logits[:num_rows], hidden[:num_rows]

    def _fill(self, g: _Graph, seqs: Sequence[GraphSequence]) -> np.ndarray:
        """The graph's buffer for `seqs`: their fields over the padding template."""
        lay = g.layout
        host = g.template.copy()
        r = lay.rows
        tables = host[lay.block_tables : lay.masks].reshape(r, lay.max_blocks)
        mask_bytes = host[lay.masks :].view(np.uint8)
        query_lens = np.zeros(r, dtype=np.int32)
        row = mask_pos = 0
        for i, s in enumerate(seqs):
            n = len(s.token_ids)
            host[row : row + n] = s.token_ids
            host[r + row : r + row + n] = s.positions
            host[2 * r + row : 2 * r + row + n] = s.slots
            host[lay.seq_lens + i] = s.seq_len
            tables[i, : len(s.block_table)] = s.block_table
            if s.tree_mask is not None:
                host[lay.mask_offsets + i] = 4 * lay.masks + mask_pos
                mask_bytes[mask_pos : mask_pos + n * n] = s.tree_mask.reshape(-1).numpy()
                mask_pos += n * n
            query_lens[i] = n
            row += n
        num_seqs, num_pad = len(seqs), r - row
        query_lens[num_seqs : num_seqs + num_pad] = 1  # one padding sequence per row left
        cu_q = host[lay.cu_q : lay.cu_q + r + 1]
        cu_q[0] = 0
        np.cumsum(query_lens, out=cu_q[1:])
        return host

    def _forward(self, g: _Graph) -> tuple[torch.Tensor, torch.Tensor]:
        """The step the graph's buffer holds, as captured."""
        lay, buf, r = g.layout, g.buffer, g.layout.rows
        metadata = self.backend.static_metadata(
            slot_mapping=buf[2 * r : 3 * r].long(),
            block_tables=buf[lay.block_tables : lay.masks].view(r, lay.max_blocks),
            cu_q=buf[lay.cu_q : lay.cu_q + r + 1],
            seq_lens=buf[lay.seq_lens : lay.seq_lens + r],
            mask_offsets=buf[lay.mask_offsets : lay.mask_offsets + r],
            masks=buf.view(torch.uint8),
            max_position=self.max_position,
        )
        hidden = self.model(buf[:r].long(), buf[r : 2 * r].long(), self.kv_caches, metadata)
        return self.model.compute_logits(hidden).float(), hidden
