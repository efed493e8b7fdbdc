"""A whole "nodes" draft tree in one C call on a CPU (`drafting.c` `speculator_draft`).

Drafting an MLP speculator's tree takes a few dozen small operations: per head a projection, a
stage, the head's product and its top k, then the selection on the host. After a decode step has
streamed the base model's weights through the caches, each of those operations made from Python
costs several times its arithmetic. `speculator_draft` runs them all in C, the products by
`rows_gemm_q8` on int8 projections and heads (`Int8Head`), and scores only the nodes the first
`num_drafts` picks can descend from (as `NodeBudget` does). The picks are those of
`MLPSpeculator.draft_candidates` with "nodes" selection on the same weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from torch import nn

from engine.kernels.cpu import CpuKernels
from engine.kernels.rows import RowsGemm
from engine.spec_decode.mlp_speculator import NORM_EPS, MLPSpeculator, SpeculatorNorm
from engine.spec_decode.tree import DraftTree


class Int8Head(nn.Module):
    """A vocabulary head (or projection) as an int8 product (the "rows" kernel's q8 format,
    `RowsGemm.matmul_q8`): int8 weights with one float32 scale per output token, a quarter of
    float32's bytes, times each input row quantised to int8, the integer products summed
    exactly; for drafting on a CPU, where reading the heads and their arithmetic dominate.
    Quantising can change which tokens are drafted, never which are emitted: the base model
    verifies every draft."""

    def __init__(self, weight: torch.Tensor, lib: RowsGemm) -> None:  # weight [out, in] float32
        super().__init__()
        self.lib = lib
        self.out_features, self.in_features = weight.shape
        # [ceil(out / 16), ceil(in / 4), 16, 4] uint8, [ceil(out / 16) * 16] float32
        self.packed, self.scales = lib.pack_q8(weight.detach().t().contiguous())

    def dequantized(self) -> torch.Tensor:  # [out, in] float32
        """The weight this head multiplies by: int8 values times their token's scale."""
        q = self.lib.unpack_q8(self.packed, self.in_features)  # [ceil(out / 16) * 16, in]
        return (q.float() * self.scales[:, None])[: self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.reshape(-1, x.shape[-1])  # [N, in]
        y = self.lib.matmul_q8(rows, self.packed, self.scales, self.out_features)  # [N, out]
        return y.view(*x.shape[:-1], self.out_features)


MAX_TOP_K = 256
"""The most tokens per head `speculator_draft` keeps."""


@dataclass(frozen=True)
class _DraftCall:
    """The host arrays of one shape of `speculator_draft` call (requests, top k per head, picks),
    made once and reused, and the call's arguments after the states' address and row stride.
    Reuse keeps a call's own work down to filling the root tokens: after a decode step has
    pushed numpy's and ctypes' state out of the caches, each new array costs microseconds."""

    root_tokens: np.ndarray  # [B] int64
    top_k: np.ndarray  # [n_heads] int64
    tokens: np.ndarray  # [B, num_drafts] int64
    parents: np.ndarray  # [B, num_drafts] int64
    scores: np.ndarray  # [B, num_drafts] float32
    counts: np.ndarray  # [B] int64
    args: tuple[int | float, ...]  # addresses of the arrays above among them


class FusedNodeDrafting:
    """`speculator_draft` over `speculator`, whose projections and heads must all be int8 (they
    are read in place: its modules must stay as they are). One call at a time: calls of one
    shape share their host arrays."""

    def __init__(self, speculator: MLPSpeculator, kernels: CpuKernels, lib: RowsGemm) -> None:
        """ValueError unless every projection and head is an `Int8Head` of `lib`."""
        fields = []
        for i in range(speculator.config.n_predict):
            proj, head = speculator.proj[i], speculator.head[i]
            if not isinstance(proj, Int8Head) or not isinstance(head, Int8Head):
                raise ValueError("fused drafting needs int8 projections and heads")
            norm = cast(SpeculatorNorm, speculator.ln[i])
            emb = cast(nn.Embedding, speculator.emb[i]).weight
            tensors: tuple[torch.Tensor, ...] = (proj.packed, proj.scales, emb, norm.weight)
            tensors += (norm.bias, head.packed, head.scales)
            if not all(t.is_contiguous() and t.device.type == "cpu" for t in tensors):
                raise ValueError("fused drafting needs contiguous CPU tensors")
            fields.append([t.data_ptr() for t in tensors])
        self.speculator = speculator
        self.kernels = kernels
        self.lib = lib
        self.heads = np.array(fields, dtype=np.int64)  # [n_heads, 7] addresses
        self.vocab = cast(Int8Head, speculator.head[0]).out_features
        self._calls: dict[tuple[int, tuple[int, ...], int], _DraftCall] = {}

    def draft(
        self,
        states: Sequence[torch.Tensor],  # per request [emb_dim] float32
        root_tokens: Sequence[int],
        top_k: Sequence[int],
        num_drafts: int,
        max_depths: Sequence[int],
    ) -> list[DraftTree]:
        """Per request, the tree of the first `num_drafts` nodes of the top-k tree in node_picks'
        order (every node after its parent), cut to `max_depths[b]` drafts deep as
        `DraftTree.from_paths` cuts paths. ValueError for a head's top k above 256 or above
        the tokens the heads score; MemoryError if the kernel runs out of memory.

        Right after a decode step each Python operation here costs microseconds (the step has
        pushed the interpreter's state out of the caches), so a single request's state is read
        in place and the host arrays are read back whole, once."""
        key = (len(root_tokens), tuple(top_k), num_drafts)
        call = self._calls.get(key) or self._prepare(*key)
        for b, token in enumerate(root_tokens):
            call.root_tokens[b] = token
        one = states[0]
        if len(states) == 1 and one.dtype is torch.float32 and one.is_contiguous():
            rows = one  # [emb_dim]: one row, whose stride the kernel does not read
        else:
            rows = torch.stack(list(states)).float()  # [B, emb_dim]
        if self.kernels.speculator_draft(rows.data_ptr(), one.shape[-1], *call.args) != 0:
            raise MemoryError("speculator_draft: out of memory")
        tokens, parents, counts = call.tokens.tolist(), call.parents.tolist(), call.counts.tolist()
        return [
            _node_tree(t[:n], p[:n], d)
            for t, p, n, d in zip(tokens, parents, counts, max_depths, strict=True)
        ]

    def _prepare(self, batch: int, top_k: tuple[int, ...], num_drafts: int) -> _DraftCall:
        if max(top_k) > min(MAX_TOP_K, self.vocab):
            raise ValueError(
                f"fused drafting takes at most {min(MAX_TOP_K, self.vocab)} tokens per head"
            )
        spec, config = self.speculator, self.speculator.config
        columns = spec.draft_vocabulary
        top_k_array = np.array(top_k, dtype=np.int64)
        root_tokens = np.empty(batch, np.int64)
        tokens = np.empty((batch, num_drafts), np.int64)
        parents = np.empty((batch, num_drafts), np.int64)
        scores = np.empty((batch, num_drafts), np.float32)
        counts = np.empty(batch, np.int64)
        args = (
            root_tokens.ctypes.data, batch, config.emb_dim, config.inner_dim,
            int(config.scale_input), self.heads.ctypes.data, top_k_array.ctypes.data, len(top_k),
            self.vocab, 0 if columns is None else columns.data_ptr(), spec.emb_scale, NORM_EPS,
            num_drafts, self.lib.q8_address, tokens.ctypes.data, parents.ctypes.data,
            scores.ctypes.data, counts.ctypes.data,
        )  # fmt: skip
        call = _DraftCall(root_tokens, top_k_array, tokens, parents, scores, counts, args)
        self._calls[(batch, top_k, num_drafts)] = call
        return call


def _node_tree(token_ids: list[int], parents: list[int], max_depth: int) -> DraftTree:
    """The tree of nodes given in an order that puts parents first (`parents[j]`: the position
    of node j's parent, -1 for the root), each node a candidate; as `DraftTree.from_paths`
    makes it from the nodes' paths, cut to `max_depth` drafts."""
    depths: list[int] = []
    if len(token_ids) > max_depth:  # else no node can be deeper than max_depth
        for p in parents:
            depths.append(1 if p < 0 else depths[p] + 1)
    if max(depths, default=0) <= max_depth:
        leaves = tuple(range(1, len(token_ids) + 1))
        return DraftTree(tuple(token_ids), tuple(p + 1 for p in parents), leaves)
    paths: list[tuple[int, ...]] = []
    for t, p in zip(token_ids, parents, strict=True):
        paths.append((*(paths[p] if p >= 0 else ()), t))
    return DraftTree.from_paths(paths, max_depth)
