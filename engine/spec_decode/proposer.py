"""Draft proposers: what the engine asks, after each step, for the next step's draft trees."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from engine.kernels.autotune import select_kernels
from engine.layers.linear import Linear
from engine.spec_decode.mlp_speculator import MLPSpeculator, check_selection, check_tree_shape
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

    def propose(self, inputs: Sequence[ProposalInput]) -> list[DraftTree]:
        """One tree per input, none deeper than its `max_depth` (>= 1)."""
        ...


class _FlatLinear(nn.Module):
    """The engine's Linear (2-D input) applied over any leading dimensions."""

    def __init__(self, linear: Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        y = self.linear(x.reshape(-1, x.shape[-1]))
        return y.view(*x.shape[:-1], y.shape[-1])


def use_engine_linears(speculator: MLPSpeculator) -> None:
    """Swap the speculator's `nn.Linear`s (each shared one once) for the engine's Linear with the
    fastest exact kernel per row count, as the base model's layers get: on a CPU its heads are
    vocabulary-sized, and drafting reads each of them at one to a few dozen rows."""
    swapped: dict[int, _FlatLinear] = {}
    for stages in (speculator.proj, speculator.head):
        for i, layer in enumerate(stages):
            if not isinstance(layer, nn.Linear):
                continue
            if id(layer) not in swapped:
                weight = layer.weight.detach()
                fast = Linear(
                    layer.in_features, layer.out_features, dtype=weight.dtype, device=weight.device
                )
                fast.load_rows(0, weight)
                swapped[id(layer)] = _FlatLinear(fast)
            stages[i] = swapped[id(layer)]
    if next(speculator.parameters()).device.type == "cpu":
        select_kernels([flat.linear for flat in swapped.values()], m_values=(1, 2, 4, 8, 16, 32))


class MLPProposer:
    """Drafts the `n_candidates` best paths of an MLPSpeculator's top-k tree, merged. Takes
    over `speculator` for inference (see `use_engine_linears`)."""

    def __init__(
        self,
        speculator: MLPSpeculator,
        top_k_tokens_per_head: Sequence[int] | None = None,
        n_candidates: int | None = None,
        selection: str = "coverage",
    ) -> None:
        """`top_k_tokens_per_head` and `n_candidates` override the speculator's config;
        `selection` is how the candidates are picked from the tree
        (`MLPSpeculator.generate_candidates`)."""
        check_selection(selection)
        config = speculator.config
        use_engine_linears(speculator)
        self.speculator = speculator
        self.top_k_tokens_per_head = tuple(top_k_tokens_per_head or config.top_k_tokens_per_head)
        self.n_candidates = n_candidates or config.n_candidates
        self.selection = selection
        check_tree_shape(config.n_predict, self.top_k_tokens_per_head, self.n_candidates)

    @property
    def num_heads(self) -> int:
        return self.speculator.config.n_predict

    @property
    def num_candidates(self) -> int:
        return self.n_candidates

    def propose(self, inputs: Sequence[ProposalInput]) -> list[DraftTree]:
        if not inputs:
            return []
        param = next(self.speculator.parameters())
        states = torch.stack([p.hidden_state for p in inputs]).to(param.device, param.dtype)
        last = torch.tensor([p.token_ids[-1] for p in inputs], device=param.device)
        paths, _ = self.speculator.generate_candidates(
            states, last, self.top_k_tokens_per_head, self.n_candidates, self.selection
        )
        return [
            DraftTree.from_paths(candidates, p.max_depth)
            for p, candidates in zip(inputs, paths.tolist(), strict=True)
        ]
