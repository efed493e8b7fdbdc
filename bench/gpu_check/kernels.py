"""Section `kernels`: the Triton paged-attention kernel's output at the head layouts the server
runs, against torch's SDPA.

Layouts: Llama-2-13B's (40 heads x 128, MHA) and GQA (40 query heads sharing 8 KV heads), in
float16 and bfloat16. One step holds every kind of row: decode rows at short and long contexts,
a prefill chunk after cached context, and a draft tree (a heap-shaped mask). The reference is
`scaled_dot_product_attention` per sequence, in float32 on the same device, over the keys and
values the kernel read from the paged cache; SDPA in the step's own dtype is reported beside it
for the rounding the dtype allows. On CPU (`--device cpu`) the kernel runs in Triton's
interpreter, on short contexts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from bench.gpu_check.models import heap_tree
from bench.gpu_check.reach import triton_and_graphs
from bench.gpu_check.report import Ctx, status

LAYOUTS = {"mha_40x128": (40, 40, 128), "gqa_40q_8kv_x128": (40, 8, 128)}
TOLERANCE = {"float16": 1e-2, "bfloat16": 4e-2}
"""Largest absolute difference from the float32 reference: a few units in the last place of
outputs of magnitude ~1 (fp16 keeps 11 bits, bf16 8)."""
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Seq:
    """One sequence of the step: `ctx` tokens cached, `n` new ones, a tree mask or causal."""

    ctx: int
    n: int
    tree: bool = False


def step_rows(small: bool) -> list[Seq]:
    if small:
        return [Seq(5, 1), Seq(40, 1), Seq(3, 17), Seq(20, 7, tree=True)]
    return [Seq(511, 1), Seq(2047, 1), Seq(100, 300), Seq(700, 16, tree=True), Seq(4000, 1)]


def run_layout(
    device: str, dtype_name: str, layout: tuple[int, int, int], seqs: list[Seq], seed: int
) -> dict[str, float]:
    """One step through `TritonBackend` and the SDPA references: the largest absolute
    differences from float32 SDPA of the kernel's output and of SDPA in the step's dtype."""
    import torch
    import torch.nn.functional as F

    from engine.attention import AttentionMetadata
    from engine.attention.triton_backend import TritonBackend

    num_heads, num_kv_heads, head_dim = layout
    group = num_heads // num_kv_heads
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device, dtype)

    blocks = [-(-(s.ctx + s.n) // BLOCK_SIZE) for s in seqs]
    free = list(range(sum(blocks) + 3))
    rng.shuffle(free)  # scattered block tables
    cache = (
        randn(len(free), BLOCK_SIZE, num_kv_heads, head_dim),
        randn(len(free), BLOCK_SIZE, num_kv_heads, head_dim),
    )
    tables = [[free.pop() for _ in range(b)] for b in blocks]
    slots = [
        t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        for s, t in zip(seqs, tables, strict=True)
        for p in range(s.ctx, s.ctx + s.n)
    ]
    masks = [heap_tree(s.n).attention_mask() if s.tree else None for s in seqs]
    num_tokens = sum(s.n for s in seqs)
    q, k, v = (randn(num_tokens, h, head_dim) for h in (num_heads, num_kv_heads, num_kv_heads))
    width = max(blocks)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        query_lens=[s.n for s in seqs],
        seq_lens=[s.ctx + s.n for s in seqs],
        block_tables=torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device
        ),
        max_position=max(s.ctx + s.n for s in seqs) - 1,
        tree_masks=masks,
    )
    backend = TritonBackend(BLOCK_SIZE)
    backend.prepare(metadata)
    out = backend.forward(q, k, v, cache, metadata)  # [N, H, D]; stores k, v first

    kernel_err = sdpa_err = 0.0
    start = 0
    for s, table, mask in zip(seqs, tables, masks, strict=True):
        length = s.ctx + s.n
        index = torch.tensor(
            [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(length)],
            device=device,
        )
        keys, values = (c.view(-1, num_kv_heads, head_dim)[index] for c in cache)  # [L, kvH, D]
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)
        visible = torch.ones(s.n, length, dtype=torch.bool, device=device)
        among = mask.to(device) if mask is not None else torch.ones(s.n, s.n).tril().bool()
        visible[:, s.ctx :] = among.to(device)
        rows = q[start : start + s.n].transpose(0, 1)  # [H, n, D]

        ref, same_dtype = (
            F.scaled_dot_product_attention(
                rows.to(t), keys.to(t), values.to(t), attn_mask=visible
            ).transpose(0, 1)  # [n, H, D]
            for t in (torch.float32, dtype)
        )
        ours = out[start : start + s.n].float()
        kernel_err = max(kernel_err, (ours - ref).abs().max().item())
        sdpa_err = max(sdpa_err, (same_dtype.float() - ref).abs().max().item())
        start += s.n
    return {"kernel": kernel_err, "sdpa_same_dtype": sdpa_err}


def section_kernels(ctx: Ctx) -> None:
    r = ctx.report
    seqs = step_rows(ctx.small or not ctx.cuda)
    r.detail("rows", [vars(s) for s in seqs])
    with triton_and_graphs() as calls:
        for seed, (name, layout) in enumerate(LAYOUTS.items()):
            for dtype_name, tolerance in TOLERANCE.items():
                tag = f"kernels.{name}.{dtype_name}"

                def check(tag: str = tag, layout: Any = layout, dtype_name: str = dtype_name,
                          tolerance: float = tolerance, seed: int = seed) -> None:  # fmt: skip
                    errors = run_layout(ctx.device, dtype_name, layout, seqs, seed)
                    r.detail(f"{tag}.sdpa_same_dtype_error", errors["sdpa_same_dtype"])
                    ok = errors["kernel"] <= tolerance
                    r.check(f"{tag}.max_error", errors["kernel"], "abs", status(ok))

                ctx.step(tag, check, min_left=3)
    launches = calls["triton_launches"]
    r.check("kernels.triton_launches", launches, "launches", status(launches > 0))
