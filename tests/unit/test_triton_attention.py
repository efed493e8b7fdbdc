"""The Triton paged-attention kernel against the torch backend, under Triton's interpreter.

Triton reads `TRITON_INTERPRET` when it is first imported (its language library is decorated
then) and again when `@triton.jit` decorates a kernel. tests/conftest.py sets it, because the
conftest's own imports already load triton (transformers -> torch._dynamo -> triton). With
`TRITON_INTERPRET=0` on a CUDA machine the same tests run the compiled kernel on the GPU.
"""

from __future__ import annotations

import os
import random
import sys
import types
from dataclasses import dataclass

import pytest
import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from engine.attention import AttentionMetadata, TorchAttentionBackend, select_backend
from engine.attention.triton_backend import TritonBackend
from tests.unit.test_attention import tree_from_parents

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if isinstance(tl.zeros, InterpretedFunction) is not INTERPRETED:
    raise RuntimeError("TRITON_INTERPRET changed after triton was imported (see tests/conftest.py)")
DEVICE = "cpu" if INTERPRETED else "cuda"

HEAD_SHAPES = [(4, 4, 64), (8, 2, 80), (6, 2, 96), (4, 1, 128)]
"""(query heads, KV heads, head size): MHA, GQA with groups of 4, 3 (rows per program not a
multiple of the group) and 4, and head sizes padded to 128 or not padded."""

SHAPE_IDS = ["x".join(map(str, s)) for s in HEAD_SHAPES]


def chain(n: int) -> torch.Tensor:
    """A draft chain: the tree mask that equals causal attention."""
    return torch.ones(n, n, dtype=torch.bool).tril()


def widths_tree(widths: list[int]) -> torch.Tensor:
    """A root with `widths[0]` children, each of which has `widths[1]` children, and so on."""
    parents, level = [-1], [0]
    for w in widths:
        nxt = []
        for p in level:
            for _ in range(w):
                parents.append(p)
                nxt.append(len(parents) - 1)
        level = nxt
    return tree_from_parents(parents)


def random_tree(n: int, seed: int) -> torch.Tensor:
    rng = random.Random(seed)
    return tree_from_parents([-1] + [rng.randrange(j) for j in range(1, n)])


@dataclass(frozen=True)
class Seq:
    """One sequence of a step: `ctx` tokens already cached, `n` new ones, optional tree."""

    ctx: int
    n: int
    tree: torch.Tensor | None = None


def run_case(
    seqs: list[Seq],
    head_shape: tuple[int, int, int],
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    backend: TritonBackend | None = None,
) -> tuple[float, float]:
    """Runs one step through the torch backend and `backend` (default: a `TritonBackend` of
    `block_size`) on equal caches; returns the largest absolute difference of the outputs and of
    the caches after the call."""
    num_heads, num_kv_heads, head_dim = head_shape
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    blocks_needed = sum(-(-(s.ctx + s.n) // block_size) for s in seqs)
    num_blocks = blocks_needed + 5
    free = list(range(num_blocks))
    rng.shuffle(free)  # block tables are scattered, not contiguous
    cache = (
        randn(num_blocks, block_size, num_kv_heads, head_dim),
        randn(num_blocks, block_size, num_kv_heads, head_dim),
    )
    tables, slots = [], []
    for s in seqs:
        table = [free.pop() for _ in range(-(-(s.ctx + s.n) // block_size))]
        tables.append(table)
        slots += [
            table[p // block_size] * block_size + p % block_size for p in range(s.ctx, s.ctx + s.n)
        ]
    width = max(len(t) for t in tables)

    # q, k and v are views into one fused projection output, as the model passes them.
    num_tokens = sum(s.n for s in seqs)
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :]
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v = v.view(num_tokens, num_kv_heads, head_dim)

    def metadata() -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=DEVICE),
            query_lens=[s.n for s in seqs],
            seq_lens=[s.ctx + s.n for s in seqs],
            block_tables=torch.tensor(
                [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE
            ),
            max_position=max(s.ctx + s.n for s in seqs) - 1,
            tree_masks=[s.tree for s in seqs],
        )

    ref_cache = (cache[0].clone(), cache[1].clone())
    ref_meta = metadata()
    reference = TorchAttentionBackend(block_size)
    reference.prepare(ref_meta)
    expected = reference.forward(q, k, v, ref_cache, ref_meta)

    meta = metadata()
    backend = backend or TritonBackend(block_size)
    backend.prepare(meta)
    out = backend.forward(q, k, v, cache, meta)

    assert out.shape == expected.shape and out.dtype == dtype
    out_err = (out.float() - expected.float()).abs().max().item()
    cache_err = max((a - b).abs().max().item() for a, b in zip(cache, ref_cache, strict=True))
    return out_err, cache_err


def check(
    seqs: list[Seq],
    head_shape: tuple[int, int, int],
    block_size: int,
    backend: TritonBackend | None = None,
) -> None:
    out_err, cache_err = run_case(seqs, head_shape, block_size, backend=backend)
    assert out_err <= 1e-5, out_err
    assert cache_err == 0.0


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("head_shape", HEAD_SHAPES, ids=SHAPE_IDS)
def test_decode_batch(head_shape: tuple[int, int, int], block_size: int) -> None:
    """One new token per sequence; contexts empty, inside a block, on and across block edges."""
    seqs = [Seq(0, 1), Seq(3, 1), Seq(15, 1), Seq(16, 1), Seq(39, 1)]
    check(seqs, head_shape, block_size)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("head_shape", HEAD_SHAPES, ids=SHAPE_IDS)
def test_chunked_prefill(head_shape: tuple[int, int, int], block_size: int) -> None:
    """A first chunk, later chunks after a cached context, and a chunk longer than one
    program's query rows and than one key tile."""
    seqs = [Seq(0, 7), Seq(13, 5), Seq(5, 35), Seq(21, 2)]
    check(seqs, head_shape, block_size)


TREES = {
    "chain": chain(6),
    "star": widths_tree([5]),
    "3x2": widths_tree([3, 2]),
    "random18": random_tree(18, seed=1),
    "random33": random_tree(33, seed=2),
}


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("tree", TREES.values(), ids=list(TREES))
def test_tree(tree: torch.Tensor, block_size: int) -> None:
    """Tree verification rows after contexts of several lengths; the larger trees span two
    programs' query rows and two key tiles."""
    n = tree.shape[0]
    seqs = [Seq(0, n, tree), Seq(11, n, tree), Seq(16, n, tree)]
    for head_shape in HEAD_SHAPES[:2]:
        check(seqs, head_shape, block_size)


def test_tree_mask_not_lower_triangular() -> None:
    """The kernel honours the mask as given, also where a row may see a later new token."""
    tree = random_tree(9, seed=3)
    tree[2, 7] = True
    check([Seq(6, 9, tree), Seq(1, 1)], HEAD_SHAPES[1], 4)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("head_shape", HEAD_SHAPES, ids=SHAPE_IDS)
def test_mixed_step(head_shape: tuple[int, int, int], block_size: int) -> None:
    """Decode rows, prefill chunks and trees in one launch, in interleaved order."""
    seqs = [
        Seq(9, 1),
        Seq(4, 10, widths_tree([3, 2])),
        Seq(0, 12),
        Seq(17, 1),
        Seq(30, 6, chain(6)),
        Seq(15, 9),
        Seq(1, 18, random_tree(18, seed=4)),
        Seq(40, 1),
        Seq(7, 1, chain(1)),
    ]
    check(seqs, head_shape, block_size)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision(dtype: torch.dtype) -> None:
    """Half-precision inputs (fp32 accumulation in the kernel) against SDPA in the same dtype;
    outputs are of order 1. Under the interpreter bf16 products run in fp32 (see the backend)."""
    seqs = [Seq(9, 1), Seq(4, 10, widths_tree([3, 2])), Seq(13, 5), Seq(0, 1)]
    out_err, cache_err = run_case(seqs, HEAD_SHAPES[1], 16, dtype=dtype)
    assert out_err <= 4 * torch.finfo(dtype).eps, out_err  # a few units in the last place
    assert cache_err == 0.0


def test_prepare_packs_one_buffer() -> None:
    """prepare() leaves every per-step tensor as a view of one device buffer: cumulative query
    starts, sequence lengths, and byte offsets of the tree masks (-1 for causal sequences)."""
    tree = widths_tree([2])
    meta = AttentionMetadata(
        slot_mapping=torch.arange(6),
        query_lens=[1, 3, 2],
        seq_lens=[5, 3, 9],
        block_tables=torch.zeros(3, 3, dtype=torch.int32),
        max_position=8,
        tree_masks=[None, tree, None],
    )
    TritonBackend(4).prepare(meta)
    p = meta.backend_data
    assert p.cu_q.tolist() == [0, 1, 4, 6]
    assert p.seq_lens.tolist() == [5, 3, 9]
    offset = p.mask_offsets[1].item()
    assert p.mask_offsets.tolist() == [-1, offset, -1]
    assert p.masks[offset : offset + 9].view(3, 3).bool().equal(tree)
    for t in (p.cu_q, p.seq_lens, p.mask_offsets):
        assert t.untyped_storage().data_ptr() == p.masks.untyped_storage().data_ptr()


def test_select_backend_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton on CUDA unless flash-attn is asked for, installed, the dtype is fp16/bf16 and the
    block size suits it; CPU choices unchanged. Building a backend touches no device."""
    flash = "engine.attention.flash_backend"
    monkeypatch.setitem(sys.modules, flash, None)  # flash-attn not installed
    for dtype in (None, torch.float32, torch.float16):
        backend = select_backend("cuda", None, dtype=dtype, flash_attention=True)
        assert isinstance(backend, TritonBackend) and backend.block_size == 16
    assert isinstance(select_backend("cuda:0", 4), TritonBackend)

    class FakeFlash(TorchAttentionBackend):
        name = "flash-attn"

    monkeypatch.setitem(sys.modules, flash, types.SimpleNamespace(FlashAttentionBackend=FakeFlash))
    assert isinstance(select_backend("cuda", None, dtype=torch.bfloat16), TritonBackend)
    assert isinstance(select_backend("cuda", None, None, torch.bfloat16, True), FakeFlash)
    assert isinstance(select_backend("cuda:1", 512, None, torch.float16, True), FakeFlash)
    assert isinstance(select_backend("cuda", 16, None, torch.float16, True), TritonBackend)
    assert isinstance(select_backend("cuda", None, None, torch.float32, True), TritonBackend)
    assert isinstance(select_backend("cuda"), TritonBackend)
    assert type(select_backend("cpu", dtype=torch.float16)) is TorchAttentionBackend
