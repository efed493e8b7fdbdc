"""Draft proposers: what the engine asks, after each step, for the next step's draft trees."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import nn

from engine.host_copy import to_device
from engine.kernels.autotune import select_kernels
from engine.kernels.rows import load_rows_gemm
from engine.layers.linear import Linear
from engine.spec_decode import mlp_speculator
from engine.spec_decode.candidates import (
    check_selection,
    check_tree_shape,
    num_candidates,
    pick_candidates,
)
from engine.spec_decode.fused_drafting import FusedNodeDrafting, Int8Head
from engine.spec_decode.mlp_speculator import MLPSpeculator
from engine.spec_decode.tree import DraftTree


@dataclass(frozen=True)
class ProposalInput:
    """One request ready to speculate: its known tokens (prompt + output; the last one has no
    K/V yet and becomes the tree's root), the base model's final-norm hidden state at the
    position that chose that last token, and the most drafts one path may hold."""

    request_id: str
    token_ids: Sequence[int]
    hidden_state: torch.Tensor  # [hidden]
    max_depth: int


class Proposer(Protocol):
    """Anything that drafts: the MLP speculator, or a test double."""

    @property
    def num_heads(self) -> int:
        """The most drafts one path can hold."""
        ...

    @property
    def num_candidates(self) -> int:
        """Candidate paths per tree (trees list them in `leaves`, best first)."""
        ...

    def propose(
        self, inputs: Sequence[ProposalInput], max_candidates: int | None = None
    ) -> list[DraftTree]:
        """One tree per input, none deeper than its `max_depth` (>= 1); with `max_candidates`,
        only its first that many candidates are needed (the rest may be left out)."""
        ...


class _FlatLinear(nn.Module):
    """The engine's Linear (2-D input) applied over any leading dimensions."""

    def __init__(self, linear: Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if x.dim() == 2:
            return self.linear(x)
        y = self.linear(x.reshape(-1, x.shape[-1]))
        return y.view(*x.shape[:-1], y.shape[-1])


def use_engine_linears(speculator: MLPSpeculator) -> None:
    """Swap the speculator's `nn.Linear`s (each shared one once) for the engine's kernels: on a
    CPU its heads are vocabulary-sized, and drafting reads each of them at one to a few dozen
    rows, streaming weights that the base model's pass has just pushed out of the caches. With
    rows_gemm.c on a CPU in float32, the heads and projections become `Int8Head`s (a quarter of
    the bytes to stream; drafting then runs whole in C, `FusedNodeDrafting`); without it,
    selection by timing chooses the kernels of float32 heads and projections as it does the
    base model's."""
    param = next(speculator.parameters())
    lib = load_rows_gemm() if param.device.type == "cpu" else None
    swapped: dict[int, nn.Module] = {}
    for stages in (speculator.proj, speculator.head):
        for i, layer in enumerate(stages):
            if not isinstance(layer, nn.Linear):
                continue
            if id(layer) not in swapped:
                weight = layer.weight.detach()
                if lib is not None and weight.dtype == torch.float32:
                    swapped[id(layer)] = Int8Head(weight, lib)
                else:
                    fast = Linear(
                        layer.in_features, layer.out_features, dtype=weight.dtype,
                        device=weight.device,
                    )  # fmt: skip
                    fast.load_rows(0, weight)
                    swapped[id(layer)] = _FlatLinear(fast)
            stages[i] = swapped[id(layer)]
    if param.device.type == "cpu" and lib is None:
        linears = [m.linear for m in swapped.values() if isinstance(m, _FlatLinear)]
        select_kernels(linears, m_values=(1, 2, 4, 8, 16, 32))


class MLPProposer:
    """Drafts the best candidates of an MLPSpeculator's top-k tree, merged into one tree: the
    `n_candidates` best paths, or with "nodes" selection the best nodes, as many as those
    paths hold drafts, so that its first k candidates are a tree of k drafts. Takes over
    `speculator` for inference (see `use_engine_linears`)."""

    def __init__(
        self,
        speculator: MLPSpeculator,
        top_k_tokens_per_head: Sequence[int] | None = None,
        n_candidates: int | None = None,
        selection: str = "nodes",
    ) -> None:
        """`top_k_tokens_per_head` and `n_candidates` (paths) override the speculator's config;
        `selection` is how the candidates are picked from the tree
        (`MLPSpeculator.draft_candidates`)."""
        check_selection(selection)
        config = speculator.config
        use_engine_linears(speculator)
        self.speculator = speculator
        self.top_k_tokens_per_head = tuple(top_k_tokens_per_head or config.top_k_tokens_per_head)
        self.n_candidates = n_candidates or config.n_candidates
        self.selection = selection
        check_tree_shape(config.n_predict, self.top_k_tokens_per_head, self.n_candidates)
        self._num_candidates = num_candidates(
            self.top_k_tokens_per_head, self.n_candidates, self.selection
        )
        self.fused: FusedNodeDrafting | None = None  # "nodes" trees in one C call, on a CPU
        param = next(speculator.parameters())
        kernels, lib = mlp_speculator.fused_kernels(param), load_rows_gemm()
        int8 = all(isinstance(m, Int8Head) for m in (*speculator.proj, *speculator.head))
        if selection == "nodes" and int8 and kernels is not None and lib is not None:
            self.fused = FusedNodeDrafting(speculator, kernels, lib)

    @property
    def num_heads(self) -> int:
        return self.speculator.config.n_predict

    @property
    def num_candidates(self) -> int:
        return self._num_candidates

    @property
    def device(self) -> torch.device:
        return next(self.speculator.parameters()).device

    @property
    def drafts_on_device(self) -> bool:
        """Whether the engine drafts before its step's read (`draft_levels`, then
        `trees_from_levels`): off a CPU, where reading the device waits for it. On a CPU,
        `propose` drafts from the host's view of the step."""
        return self.fused is None and self.device.type != "cpu"

    def draft_levels(
        self,
        states: torch.Tensor,  # [B, hidden] on the speculator's device
        token_ids: torch.Tensor,  # [B] int64: the tokens chosen from them, on that device
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The whole top-k tree of each row on the device (`MLPSpeculator.draft_levels`)."""
        param = next(self.speculator.parameters())
        return self.speculator.draft_levels(
            states.to(param.dtype), token_ids, self.top_k_tokens_per_head
        )

    def trees_from_levels(
        self,
        levels: Sequence[tuple[np.ndarray, np.ndarray]],  # `draft_levels`' levels on the host
        rows: Sequence[int],  # the rows to make trees of
        max_depths: Sequence[int],  # [len(rows)]
        max_candidates: int | None = None,
    ) -> list[DraftTree]:
        """The trees `propose` makes of those rows' inputs (`max_candidates` as there)."""
        batch = levels[0][0].shape[0]  # the first head's rows: one root per row
        paths, _ = pick_candidates(
            levels, batch, self.top_k_tokens_per_head, self.n_candidates, self.selection,
            num_drafts=max_candidates,
        )  # fmt: skip
        return [
            DraftTree.from_paths([[t for t in path if t >= 0] for path in paths[r].tolist()], d)
            for r, d in zip(rows, max_depths, strict=True)
        ]

    def propose(
        self, inputs: Sequence[ProposalInput], max_candidates: int | None = None
    ) -> list[DraftTree]:
        if not inputs:
            return []
        if self.fused is not None:  # float32 on a CPU
            num_drafts = min(max_candidates or self._num_candidates, self._num_candidates)
            return self.fused.draft(
                [p.hidden_state for p in inputs],
                [p.token_ids[-1] for p in inputs],
                self.top_k_tokens_per_head,
                num_drafts,
                [p.max_depth for p in inputs],
            )
        param = next(self.speculator.parameters())
        states = _stacked(inputs, param.dtype, param.device)
        last = _on_device([p.token_ids[-1] for p in inputs], param.device)
        paths, _ = self.speculator.draft_candidates(
            states,
            last,
            self.top_k_tokens_per_head,
            self.n_candidates,
            self.selection,
            num_drafts=max_candidates,
        )  # [B, N, n_predict] on the host
        return [
            DraftTree.from_paths([[t for t in path if t >= 0] for path in candidates], p.max_depth)
            for p, candidates in zip(inputs, paths.tolist(), strict=True)
        ]


def _on_device(token_ids: list[int], device: torch.device) -> torch.Tensor:  # [B] int64
    """Token ids on `device`, by a copy that does not wait for it (`host_copy.to_device`)."""
    return to_device(torch.tensor(token_ids, dtype=torch.int64), device)


def _stacked(
    inputs: Sequence[ProposalInput], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:  # [B, hidden]
    """The inputs' hidden states as one [B, hidden] tensor of `dtype` on `device`, rows
    contiguous (a view of a single input's state where it already is one)."""
    states = [p.hidden_state for p in inputs]
    one = states[0]
    if len(states) == 1 and one.dtype == dtype and one.device == device and one.is_contiguous():
        return one.unsqueeze(0)
    return torch.stack(states).to(device, dtype)
