"""Paged attention against dense attention computed per sequence from contiguous K/V."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from engine.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend, cpu_backend
from engine.attention.cpu_backend import CpuAttentionBackend
from engine.kernels.cpu import load_cpu_kernels
from engine.kernels.rows import load_rows_gemm

H, KVH, D = 4, 2, 8
HEAD_SHAPES = [(4, 2, 8), (9, 3, 64), (8, 8, 128), (6, 2, 40)]
"""(query heads, key heads, head size): the C kernel has paths for 64 and 128, vector loops for
multiples of 16 and scalar tails."""


def _fused(block_size: int, parallel: bool = False) -> AttentionBackend:
    kernels = load_cpu_kernels()
    assert kernels is not None, "the C kernels must build on a machine with a C compiler"
    return CpuAttentionBackend(kernels, block_size, parallel)


def _fused_threads(block_size: int) -> AttentionBackend:
    """The fused backend on the rows kernels' pool of two threads."""
    rows = load_rows_gemm()
    assert rows is not None, "the rows library must build on a machine with a C compiler"
    rows.set_threads(2)
    backend = _fused(block_size, parallel=True)
    assert isinstance(backend, CpuAttentionBackend) and backend.pool_run_address != 0
    return backend


BACKENDS: dict[str, Callable[[int], AttentionBackend]] = {
    "torch": TorchAttentionBackend,
    "fused": _fused,
    "fused-threads": _fused_threads,
}


@pytest.fixture(params=["torch", "fused", "fused-threads", "fused-over-sdpa"])
def make_backend(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Callable[[int], AttentionBackend]:
    """Each backend: the fused one on the calling thread, on two pool threads (units of key
    heads and query rows claimed by both), or with its work threshold at 0 so that it hands the
    step to SDPA."""
    if request.param == "fused-over-sdpa":
        monkeypatch.setattr(cpu_backend, "FUSED_MAX_WORK", 0)
        return _fused
    return BACKENDS[request.param]


def dense_attention(
    q: torch.Tensor,  # [n, H, D]
    k: torch.Tensor,  # [L, KVH, D]
    v: torch.Tensor,  # [L, KVH, D]
    visible: torch.Tensor,  # [n, L] bool
) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).double()
    v = v.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / q.shape[2] ** 0.5
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


def tree_from_parents(parents: list[int]) -> torch.Tensor:
    """Ancestor mask (each node sees itself and its ancestors) of a tree given by each node's
    parent index, -1 for the root; parents precede children."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for j in range(n):
        a = j
        while a != -1:
            mask[j, a] = True
            a = parents[a]
    return mask


def random_tree_mask(n: int, rng: random.Random) -> torch.Tensor:
    """Ancestor mask of a random tree rooted at token 0 (parents precede children)."""
    return tree_from_parents([-1] + [rng.randrange(j) for j in range(1, n)])


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("with_trees", [False, True])
@pytest.mark.parametrize("head_shape", HEAD_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_paged_equals_dense(
    make_backend: Callable[[int], AttentionBackend],
    block_size: int,
    with_trees: bool,
    head_shape: tuple[int, int, int],
) -> None:
    H, KVH, D = head_shape
    rng = random.Random(block_size * 2 + with_trees)
    backend = make_backend(block_size)
    num_blocks = 64
    cache = (
        torch.randn(num_blocks, block_size, KVH, D),
        torch.randn(num_blocks, block_size, KVH, D),
    )
    free = list(range(num_blocks))
    rng.shuffle(free)  # block tables are scattered, not contiguous

    ctx_lens = [0, 5, 13, 1, 7]
    query_lens = [6, 1, 4, 1, 5]
    seq_k, seq_v, tables, slots, trees = [], [], [], [], []
    for ctx, n in zip(ctx_lens, query_lens, strict=True):
        total = ctx + n
        table = [free.pop() for _ in range(-(-total // block_size))]
        tables.append(table)
        k, v = torch.randn(total, KVH, D), torch.randn(total, KVH, D)
        for p in range(ctx):  # the cached context is already in the cache
            b, o = table[p // block_size], p % block_size
            cache[0][b, o], cache[1][b, o] = k[p], v[p]
        seq_k.append(k)
        seq_v.append(v)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx, total)]
        trees.append(random_tree_mask(n, rng) if with_trees and n > 1 else None)

    # q, k and v are views into one fused projection output, as the model passes them.
    num_tokens = sum(query_lens)
    qkv = torch.randn(num_tokens, (H + 2 * KVH) * D)
    q = qkv[:, : H * D].view(num_tokens, H, D)
    new_k = qkv[:, H * D : (H + KVH) * D].view(num_tokens, KVH, D)
    new_v = qkv[:, (H + KVH) * D :].view(num_tokens, KVH, D)
    new_k.copy_(torch.cat([k[c:] for k, c in zip(seq_k, ctx_lens, strict=True)]))
    new_v.copy_(torch.cat([v[c:] for v, c in zip(seq_v, ctx_lens, strict=True)]))
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_lens=query_lens,
        seq_lens=[c + n for c, n in zip(ctx_lens, query_lens, strict=True)],
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_position=max(ctx_lens) + max(query_lens),
        tree_masks=trees,
    )
    backend.prepare(meta)
    out = backend.forward(q, new_k, new_v, cache, meta)

    start = 0
    for i, (ctx, n) in enumerate(zip(ctx_lens, query_lens, strict=True)):
        visible = torch.ones(n, ctx + n, dtype=torch.bool)
        visible[:, ctx:] = trees[i] if trees[i] is not None else torch.ones(n, n).tril().bool()
        expected = dense_attention(q[start : start + n], seq_k[i], seq_v[i], visible)
        torch.testing.assert_close(out[start : start + n], expected, atol=1e-5, rtol=1e-5)
        start += n
    # The new tokens' K/V landed in their slots.
    torch.testing.assert_close(cache[0].view(-1, KVH, D)[torch.tensor(slots)], new_k)


def test_single_decode_fast_path(make_backend: Callable[[int], AttentionBackend]) -> None:
    backend = make_backend(4)
    cache = (torch.randn(8, 4, KVH, D), torch.randn(8, 4, KVH, D))
    table = [5, 2, 7]
    k, v = torch.randn(10, KVH, D), torch.randn(10, KVH, D)
    for p in range(9):
        cache[0][table[p // 4], p % 4], cache[1][table[p // 4], p % 4] = k[p], v[p]
    q = torch.randn(1, H, D)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([table[2] * 4 + 1]),
        query_lens=[1],
        seq_lens=[10],
        block_tables=torch.tensor([table], dtype=torch.int32),
        max_position=9,
        tree_masks=[None],
    )
    backend.prepare(meta)
    out = backend.forward(q, k[9:], v[9:], cache, meta)
    expected = dense_attention(q, k, v, torch.ones(1, 10, dtype=torch.bool))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_pool_threads_match_the_calling_thread() -> None:
    """Units claimed by two pool threads give the calling thread's results bit for bit, over
    sequences of growing lengths (each thread's scratch grows with them) and tree masks."""
    rng = random.Random(7)
    H, KVH, D, block_size = 9, 3, 64, 16
    alone, pooled = _fused(block_size), _fused_threads(block_size)
    for ctx_lens in ([3, 40], [1, 300, 17], [700]):
        query_lens = [rng.randrange(1, 9) for _ in ctx_lens]
        tables, slots, next_block = [], [], 0
        for ctx, n in zip(ctx_lens, query_lens, strict=True):
            num_blocks = -(-(ctx + n) // block_size)
            tables.append(list(range(next_block, next_block + num_blocks)))
            next_block += num_blocks
            slots += [tables[-1][p // block_size] * block_size + p % block_size
                      for p in range(ctx, ctx + n)]  # fmt: skip
        width = max(len(t) for t in tables)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            query_lens=query_lens,
            seq_lens=[c + n for c, n in zip(ctx_lens, query_lens, strict=True)],
            block_tables=torch.tensor(
                [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32
            ),
            max_position=max(c + n for c, n in zip(ctx_lens, query_lens, strict=True)),
            tree_masks=[random_tree_mask(n, rng) if n > 1 else None for n in query_lens],
        )
        cache = (
            torch.randn(next_block, block_size, KVH, D),
            torch.randn(next_block, block_size, KVH, D),
        )
        num_tokens = sum(query_lens)
        q, k, v = (
            torch.randn(num_tokens, H, D),
            torch.randn(num_tokens, KVH, D),
            torch.randn(num_tokens, KVH, D),
        )
        outs = []
        for backend in (alone, pooled):
            layer_cache = (cache[0].clone(), cache[1].clone())
            backend.prepare(meta)
            outs.append(backend.forward(q, k, v, layer_cache, meta))
        assert torch.equal(outs[0], outs[1])
