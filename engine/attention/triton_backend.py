"""CUDA backend on the Triton kernels of engine/attention/triton_kernels.py, which read the
paged KV cache in place.

A single varlen launch serves every kind of row a step can hold (decode rows, prefill chunks,
draft-tree rows). When that launch would leave streaming multiprocessors idle and the context is
long, the keys of each (query block, KV head) are split over several programs and a second
launch merges their partial softmax results (`num_kv_splits` says when).

Every kernel variant a server launches is compiled by `warm_up` at start-up: the launches vary
only in arguments that are not specialized (see triton_kernels.py), so a step never compiles.

The kernels also run on CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1` set before
triton is first imported), which is how the tests check them against the torch backend.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.attention.backend import AttentionBackend, AttentionMetadata, KVCache
from engine.attention.triton_kernels import merge_splits_kernel, paged_attention_kernel

logger = logging.getLogger(__name__)

BLOCK_N = 32
"""Keys per inner-loop tile; a tile may span several cache blocks."""

MIN_BLOCK_M = 16
"""Rows per program at least: `tl.dot` needs 16 on every side."""

MAX_KV_SPLITS = 16
"""The most programs one (query block, KV head) is split into (a power of two)."""

MIN_SPLIT_KEYS = 256
"""Fewest keys one split walks (a multiple of `BLOCK_N`), eight key tiles. Such a split reads
256 x D keys and values of its KV head; its extra traffic, one fp32 partial row per query head
written and read back by the merge, is 1/128 of those bytes (fp16) per query head: under 1%
with MHA, about 6% with groups of 8 query heads."""

_LOG2E = 1.4426950408889634

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def num_kv_splits(
    num_programs: int, max_seq_len: int | None, num_sms: int, min_split_keys: int
) -> int:
    """How many programs share the keys of each (query block, KV head); 1: the unsplit kernel.

    Splitting pays only when the unsplit grid of `num_programs` working programs leaves some of
    the `num_sms` multiprocessors idle: then each program's keys are split so the grid fills
    about one wave, `ceil(num_sms / num_programs)` splits, at most `MAX_KV_SPLITS`. A split
    walks at least `min_split_keys` keys, so a batch whose longest sequence holds L tokens uses
    at most `L // min_split_keys` splits (none below `2 * min_split_keys`). `max_seq_len` None
    (a CUDA graph's step, whose lengths are unknown at capture) leaves that cap to the kernel,
    which gives a short context fewer non-empty splits; the choice then depends on the row
    count only, fixed per captured graph.
    """
    if num_programs >= num_sms:
        return 1
    splits = min(MAX_KV_SPLITS, -(-num_sms // max(1, num_programs)))
    if max_seq_len is not None:
        splits = min(splits, max_seq_len // min_split_keys)
    return max(1, splits)


def rows_per_program(num_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): rows of one program, and the query tokens they hold."""
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not share {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    block_m = max(MIN_BLOCK_M, triton.next_power_of_2(group))
    return block_m, block_m // group


@dataclass
class _Prepared:
    """Per-step kernel inputs, all slices of one device buffer filled by one host copy.

    The buffer holds the int32 arrays first, then the tree masks as bytes; `masks` is the whole
    buffer, so `mask_offsets` are byte offsets into it. `query_lens` and `max_seq_len` are the
    host's view for the split choice, None for a CUDA graph's step; the first layer's forward
    sets `num_splits` for the others.
    """

    cu_q: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    mask_offsets: torch.Tensor  # [S] int32, -1 for causal sequences
    masks: torch.Tensor  # uint8
    query_lens: list[int] | None = None
    max_seq_len: int | None = None
    num_splits: int | None = None


class TritonBackend(AttentionBackend):
    """Paged attention in Triton: decode, chunked prefill and draft-tree rows in the same
    launch, any block size, MHA or GQA, fp16, bf16 or fp32 with fp32 accumulation, split over
    the keys when the grid is small and the context long.

    The cache must be contiguous ([num_blocks, block_size, kvH, D]) and the last dimension of
    q contiguous; q itself may be a strided view. Tree masks come on the host (as the model
    runner builds them); a mask on the device is copied back, which synchronizes.

    `num_sms`: the multiprocessors the split choice fills (None: the CUDA device's count, and 1,
    never split, off CUDA); `min_split_keys`: fewest keys of one split.
    """

    name = "triton"

    def __init__(
        self,
        block_size: int | None = None,
        num_sms: int | None = None,
        min_split_keys: int = MIN_SPLIT_KEYS,
    ) -> None:
        if min_split_keys <= 0 or min_split_keys % BLOCK_N:
            raise ValueError(f"min_split_keys must be a positive multiple of {BLOCK_N}")
        self.block_size = block_size or 16
        self.num_sms = num_sms
        self.min_split_keys = min_split_keys

    def prepare(self, metadata: AttentionMetadata) -> None:
        device = metadata.block_tables.device
        query_lens, num_seqs = metadata.query_lens, metadata.num_seqs
        int_bytes = 4 * (3 * num_seqs + 1)
        mask_offsets: list[int] = []
        masks: list[torch.Tensor] = []
        offset = int_bytes
        for tree, n in zip(metadata.tree_masks, query_lens, strict=True):
            if tree is None:
                mask_offsets.append(-1)
                continue
            mask_offsets.append(offset)
            masks.append(tree.reshape(n * n).to("cpu", torch.uint8))
            offset += n * n
        ints = torch.tensor(
            [0, *query_lens, *metadata.seq_lens, *mask_offsets], dtype=torch.int32
        )  # [3S + 1]
        ints[: num_seqs + 1] = ints[: num_seqs + 1].cumsum(0)
        host = torch.cat([ints.view(torch.uint8), *masks])
        if device.type == "cuda":
            buf = host.pin_memory().to(device, non_blocking=True)
        else:
            buf = host.to(device)
        int_view = buf[:int_bytes].view(torch.int32)
        metadata.backend_data = _Prepared(
            cu_q=int_view[: num_seqs + 1],
            seq_lens=int_view[num_seqs + 1 : 2 * num_seqs + 1],
            mask_offsets=int_view[2 * num_seqs + 1 :],
            masks=buf,
            query_lens=list(query_lens),
            max_seq_len=max(metadata.seq_lens, default=0),
        )

    @staticmethod
    def static_metadata(
        slot_mapping: torch.Tensor,  # [N] int64
        block_tables: torch.Tensor,  # [S, max_blocks] int32, rows may be strided
        cu_q: torch.Tensor,  # [S + 1] int32
        seq_lens: torch.Tensor,  # [S] int32, contiguous
        mask_offsets: torch.Tensor,  # [S] int32: byte offsets into `masks`, -1 when causal
        masks: torch.Tensor,  # uint8
        max_position: int,
    ) -> AttentionMetadata:
        """The metadata of a step whose kernel inputs already live in the given device tensors
        (a CUDA graph's static buffers), without `prepare`'s host copy. Its host-side lists
        are placeholders: only their number of sequences is right. Such a step's split choice
        depends on its row count only (see `num_kv_splits`)."""
        num_seqs = cu_q.shape[0] - 1
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            query_lens=[1] * num_seqs,
            seq_lens=[],
            block_tables=block_tables,
            max_position=max_position,
            tree_masks=[None] * num_seqs,
            backend_data=_Prepared(cu_q, seq_lens, mask_offsets, masks),
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        self.store(k, v, kv_cache, metadata.slot_mapping)
        p: _Prepared = metadata.backend_data
        if p.num_splits is None:  # once per step: every layer has the same heads
            p.num_splits = self._num_splits(q, kv_cache[0].shape[2], p)
        return self.attend(q, kv_cache, metadata.block_tables, p, metadata.num_seqs, p.num_splits)

    def _num_splits(self, q: torch.Tensor, num_kv_heads: int, p: _Prepared) -> int:
        """`num_kv_splits` for this step, over its working programs (a graph's: the fewest its
        rows may fill)."""
        _, block_q = rows_per_program(q.shape[1], num_kv_heads)
        if p.query_lens is None:
            q_blocks = -(-q.shape[0] // block_q)
        else:
            q_blocks = sum(-(-n // block_q) for n in p.query_lens)
        if self.num_sms is None:
            cuda = q.device.type == "cuda"
            self.num_sms = (
                torch.cuda.get_device_properties(q.device).multi_processor_count if cuda else 1
            )
        return num_kv_splits(
            q_blocks * num_kv_heads, p.max_seq_len, self.num_sms, self.min_split_keys
        )

    def attend(
        self,
        q: torch.Tensor,  # [N, H, D]
        kv_cache: KVCache,
        block_tables: torch.Tensor,
        p: _Prepared,
        num_seqs: int,
        num_splits: int,
    ) -> torch.Tensor:  # [N, H, D]
        """The kernel launches of one step, its keys split `num_splits` ways (1: unsplit)."""
        if not 1 <= num_splits <= MAX_KV_SPLITS:
            raise ValueError(f"num_splits must be in [1, {MAX_KV_SPLITS}], got {num_splits}")
        key_cache, value_cache = kv_cache
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = key_cache.shape[2]
        block_m, block_q = rows_per_program(num_heads, num_kv_heads)
        if q.stride(2) != 1:
            q = q.contiguous()
        dot_dtype = q.dtype
        if q.device.type == "cpu" and q.dtype == torch.bfloat16:
            dot_dtype = torch.float32  # the interpreter's tl.dot takes no bf16
        head_pad = max(16, triton.next_power_of_2(head_dim))
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [N, H, D]
        split = num_splits > 1
        partial, lse = out, out  # unused by the unsplit kernel
        if split:
            shape = (num_tokens, num_heads, num_splits)
            partial = torch.empty((*shape, head_pad), dtype=torch.float32, device=q.device)
            lse = torch.empty(shape, dtype=torch.float32, device=q.device)
        grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
        paged_attention_kernel[grid](
            out,
            partial,
            lse,
            q,
            key_cache,
            value_cache,
            block_tables,
            p.cu_q,
            p.seq_lens,
            p.mask_offsets,
            p.masks,
            _LOG2E / math.sqrt(head_dim),
            num_seqs,
            num_splits,
            self.min_split_keys,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            block_tables.stride(0),
            HEAD_DIM=head_dim,
            HEAD_PAD=head_pad,
            GROUP=num_heads // num_kv_heads,
            BLOCK_M=block_m,
            BLOCK_Q=block_q,
            BLOCK_N=BLOCK_N,
            PAGE=key_cache.shape[1],
            DOT_DTYPE=_TL_DTYPES[dot_dtype],
            DOT_PRECISION="ieee" if dot_dtype == torch.float32 else "tf32",
            SPLIT=split,
        )
        if split:
            merge_splits_kernel[(num_tokens * num_heads,)](
                out,
                partial,
                lse,
                num_splits,
                HEAD_DIM=head_dim,
                HEAD_PAD=head_pad,
                MAX_SPLITS=MAX_KV_SPLITS,
            )
        return out

    def warm_up(self, kv_caches: Sequence[KVCache], num_heads: int) -> int:
        """Compile every kernel variant the steps will launch on these caches with `num_heads`
        query heads, by launching each once: one decode row on cache block 0, unsplit and split.
        A variant differs only in what stays specialized, fixed for a server's life except the
        caches' 16-byte alignment, so this runs once per distinct alignment of the layers'
        caches (one, with the model runner's pool). Reads the caches, writes scratch tensors
        only. Returns the number of launches."""
        launches = 0
        alignments: set[tuple[bool, bool]] = set()
        for kv_cache in kv_caches:
            alignment = (kv_cache[0].data_ptr() % 16 == 0, kv_cache[1].data_ptr() % 16 == 0)
            if alignment in alignments:
                continue
            alignments.add(alignment)
            device, head_dim = kv_cache[0].device, kv_cache[0].shape[3]
            metadata = AttentionMetadata(
                slot_mapping=torch.zeros(1, dtype=torch.int64, device=device),
                query_lens=[1],
                seq_lens=[1],
                block_tables=torch.zeros((1, 1), dtype=torch.int32, device=device),
                max_position=0,
                tree_masks=[None],
            )
            self.prepare(metadata)
            q = torch.zeros((1, num_heads, head_dim), dtype=kv_cache[0].dtype, device=device)
            # Triton compiles for, and launches on, the current device: make it the caches'.
            with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
                for num_splits in (1, 2):
                    p = metadata.backend_data
                    self.attend(q, kv_cache, metadata.block_tables, p, 1, num_splits)
                    launches += num_splits  # the split step's merge is a second kernel
        return launches


def warm_up(backend: AttentionBackend, kv_caches: Sequence[KVCache], num_heads: int) -> int:
    """Compile the Triton attention variants a server will launch, once, before it serves:
    `backend` is the Triton backend or one that falls back to it (flash-attn's, for tree steps);
    `num_heads` the query heads of this process's shard. Returns the number of launches (0 for
    a backend without Triton kernels)."""
    triton_backend = backend if isinstance(backend, TritonBackend) else None
    fallback = getattr(backend, "_fallback", None)  # FlashAttentionBackend's tree-step backend
    if isinstance(fallback, TritonBackend):
        triton_backend = fallback
    if triton_backend is None:
        return 0
    start = time.perf_counter()
    launches = triton_backend.warm_up(kv_caches, num_heads)
    logger.info(
        "compiled the Triton attention kernels (%d warm-up launches) in %.1f s",
        launches,
        time.perf_counter() - start,
    )
    return launches
