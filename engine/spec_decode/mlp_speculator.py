"""IBM's MLP speculator ("accelerator"): `n_predict` recurrent MLP stages over the base model's
final-norm hidden state, each drafting one more token.

Stage i maps a state `s_i` and a token `tok_i` to

    s_{i+1}  = GELU(ln_i(proj_i(s_i) + (alpha / beta) * emb_i(tok_i)))
    logits_i = head_i(s_{i+1})

with `beta = 0.5 ** (0.5 / n_predict)`, `alpha = sqrt((1 - beta**2) * inner_dim / 2)`, `ln_i` an
RMS norm with weight and bias (no mean subtraction, eps 1e-6) and the exact erf GELU. `s_0` is the
base state (with `scale_input`: a parameter-free RMS norm of it, divided by sqrt(2)); `tok_0` is
the token the base model chose from that state, so head i drafts the token i+1 places after it.

A speculator may draft from a *draft vocabulary*, a subset of the base vocabulary (for one
trained here, the tokens most often the base model's top-1 in its training data: FR-Spec's
frequency-ranked drafting): its heads then score only those tokens, which makes drafting several
times cheaper where the heads' [vocab, inner] products dominate it, as they do at a CPU's memory
bandwidth. The subset is stored beside the published checkpoint in `draft_vocabulary.json`,
which other servers ignore.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.cpu import CpuKernels, load_cpu_kernels
from engine.spec_decode.candidates import (
    NodeBudget,
    check_selection,
    check_tree_shape,
    levels_on_host,
    pick_candidates,
)
from engine.spec_decode.speculator_config import MLPSpeculatorConfig

NORM_EPS = 1e-6  # the norms' epsilon, and scale_input's


class SpeculatorNorm(nn.Module):
    """fms's LayerNormParameterized as the speculator uses it: `w * x / rms(x) + b`."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * _rms_normalize(x) + self.bias


def fused_kernels(state: torch.Tensor) -> CpuKernels | None:
    """The fused C kernels of a stage and of a head's top k, for float32 on a CPU (where each
    replaces a dozen ATen ops on tensors of a few rows); None elsewhere."""
    if state.device.type != "cpu" or state.dtype != torch.float32:
        return None
    return load_cpu_kernels()


def _rms_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / rms(x), computed in float32 (a half-precision square overflows above 256 and loses
    digits in the mean) and cast back to x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + NORM_EPS)).type_as(x)


class MLPSpeculator(nn.Module):
    """The speculator's weights and maths. Parameter names (`emb.i`, `proj.i`, `head.i`,
    `ln.i.weight/bias`) are the checkpoint's, without the HF wrapper's `speculator.` prefix.
    With `tie_weights`, every stage shares `emb.0`, `head.0` and `ln.0`, and stages >= 2 share
    `proj.1` (`proj.0` reads the base width)."""

    def __init__(
        self,
        config: MLPSpeculatorConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.config = config
        n, d_in, d, vocab = config.n_predict, config.emb_dim, config.inner_dim, config.vocab_size
        device = torch.device(device)

        def linear(fan_in: int, fan_out: int) -> nn.Linear:
            return nn.Linear(fan_in, fan_out, bias=False, dtype=dtype, device=device)

        def emb() -> nn.Embedding:
            return nn.Embedding(vocab, d, dtype=dtype, device=device)

        def norm() -> SpeculatorNorm:
            return SpeculatorNorm(d, dtype, device)

        if config.tie_weights:
            emb0, head0, ln0 = emb(), linear(d, vocab), norm()
            proj1 = linear(d, d) if n > 1 else None
            self.emb = nn.ModuleList([emb0] * n)
            self.proj = nn.ModuleList([linear(d_in, d)] + [proj1] * (n - 1))  # type: ignore[list-item]
            self.head = nn.ModuleList([head0] * n)
            self.ln = nn.ModuleList([ln0] * n)
        else:
            self.emb = nn.ModuleList([emb() for _ in range(n)])
            self.proj = nn.ModuleList([linear(d_in if i == 0 else d, d) for i in range(n)])
            self.head = nn.ModuleList([linear(d, vocab) for _ in range(n)])
            self.ln = nn.ModuleList([norm() for _ in range(n)])
        beta = 0.5 ** (0.5 / n)
        alpha = math.sqrt((1 - beta**2) * d / 2)
        self.emb_scale = alpha / beta
        self.draft_vocabulary: torch.Tensor | None = None  # [V'] int64, when restricted

    @torch.no_grad()
    def restrict_vocabulary(self, token_ids: torch.Tensor) -> None:
        """Draft only `token_ids` [V'] (distinct base token ids): each head keeps those rows
        (a shared head stays shared), so head logits are over `token_ids`, in their order, and
        `draft_candidates` maps its picks back to base ids. For inference only: the
        teacher-forced `forward` then scores the subset too."""
        if self.draft_vocabulary is not None:
            raise ValueError("the speculator's vocabulary is already restricted")
        ids = torch.as_tensor(token_ids, dtype=torch.int64).flatten()
        vocab = self.config.vocab_size
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"draft vocabulary must be non-empty token ids below {vocab}")
        if torch.unique(ids).numel() != ids.numel():
            raise ValueError("draft vocabulary has repeated token ids")
        ids = ids.to(cast(nn.Linear, self.head[0]).weight.device)
        sliced: dict[int, nn.Linear] = {}
        for i, head in enumerate(self.head):
            full = cast(nn.Linear, head)
            if id(full) not in sliced:
                weight = full.weight[ids]  # [V', inner]
                small = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
                small.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
                sliced[id(full)] = small
            self.head[i] = sliced[id(full)]
        self.draft_vocabulary = ids

    @property
    def num_draft_tokens(self) -> int:
        """How many tokens the heads score: the draft vocabulary's, else the whole vocabulary."""
        if self.draft_vocabulary is None:
            return self.config.vocab_size
        return self.draft_vocabulary.numel()

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """fms's initialisation: every weight ~ N(0, 1/sqrt(inner_dim)); norms 1 and 0."""
        std = 1 / math.sqrt(self.config.inner_dim)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.startswith("ln."):
                    p.fill_(1.0 if name.endswith("weight") else 0.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * std)

    def initial_state(self, state: torch.Tensor) -> torch.Tensor:
        """`s_0` from the base model's final-norm hidden state [..., emb_dim]."""
        if self.config.scale_input:
            return _rms_normalize(state) / math.sqrt(2)
        return state

    def stage(self, i: int, state: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """`s_{i+1}` [..., inner_dim] from `s_i` [..., d] and `tok_i` [...]."""
        z = self.emb[i](token_ids) * self.emb_scale
        return F.gelu(self.ln[i](self.proj[i](state) + z))

    def _draft_stage(
        self,
        i: int,
        projected: torch.Tensor,  # [G, 1, inner_dim]: proj_i(s_i) of each group's parent
        token_ids: torch.Tensor,  # [G, c]: the tokens drafted from that parent
    ) -> torch.Tensor:  # [G * c, inner_dim]
        """`stage` for groups of tokens that share their parent's state (so its projection),
        for inference: the same operations on the same values, written in place where `stage`
        makes a new tensor."""
        norm = cast(SpeculatorNorm, self.ln[i])
        weight = cast(nn.Embedding, self.emb[i]).weight
        x = F.embedding(token_ids, weight).mul_(self.emb_scale).add_(projected)  # [G, c, d]
        x = _rms_normalize(x)
        return F.gelu(x.mul_(norm.weight).add_(norm.bias)).flatten(0, 1)

    def forward(
        self,
        state: torch.Tensor,  # [B, L, emb_dim]: base states at positions t
        token_ids: torch.Tensor,  # [B, L + n_predict]: token_ids[:, t] was chosen from state t
    ) -> torch.Tensor:  # [n_predict, B, L, vocab]: head i scores token t + 2 + i
        """Teacher-forced training forward: stage i reads `token_ids[:, i : i + L]`."""
        length = state.shape[1]
        s = self.initial_state(state)
        logits = []
        for i in range(self.config.n_predict):
            s = self.stage(i, s, token_ids[:, i : i + length])
            logits.append(self.head[i](s))
        return torch.stack(logits)

    @torch.inference_mode()
    def draft_candidates(
        self,
        state: torch.Tensor,  # [B, emb_dim]: final-norm state where the base chose token_ids
        token_ids: torch.Tensor,  # [B] int64
        top_k_tokens_per_head: Sequence[int],
        n_candidates: int,
        selection: str = "joint",
        num_drafts: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:  # [B, N, n] int64 paths, [B, N] float32 scores
        """N = `candidates.num_candidates(top_k_tokens_per_head, n_candidates, selection)` paths and
        their summed log-probabilities, on the host, from a tree that branches into the top
        `top_k_tokens_per_head[i]` tokens at head i. Children carry their parent's new state;
        leaves are in mixed-radix order of their ranks (fms-extras' `generate_suffixes`).
        `selection` "joint" keeps the `n_candidates` leaves of highest summed log-probability,
        best first (fms-extras); "coverage" picks `n_candidates` leaves one at a time, each
        adding the most expected accepted drafts to those already picked (`coverage_picks`);
        "nodes" takes the nodes of highest summed log-probability, as many as `n_candidates`
        paths hold drafts (`node_picks`), each as its path, padded with -1 below the node.
        With "nodes" and `num_drafts`, N is at most `num_drafts`: the same first picks, and on
        a CPU the heads score only the nodes those can descend from (`NodeBudget`).

        The stages and each head's top k run on `state`'s device; one copy brings the tree's
        log-probabilities and tokens to the host, where the selection is made."""
        check_tree_shape(self.config.n_predict, top_k_tokens_per_head, n_candidates)
        check_selection(selection)
        batch = state.shape[0]
        if num_drafts is not None and selection == "nodes" and state.device.type == "cpu":
            budget = NodeBudget(batch, num_drafts)
            host = self._levels(state, token_ids, top_k_tokens_per_head, budget)
        else:
            host = levels_on_host(self.draft_levels(state, token_ids, top_k_tokens_per_head))
        return pick_candidates(
            host, batch, top_k_tokens_per_head, n_candidates, selection, num_drafts
        )

    @torch.inference_mode()
    def draft_levels(
        self,
        state: torch.Tensor,  # [B, emb_dim]
        token_ids: torch.Tensor,  # [B] int64
        top_k_tokens_per_head: Sequence[int],
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:  # per head: [B * F, k] log-probs, token ids
        """The whole top-k tree of `draft_candidates` on `state`'s device, nothing read on the
        host: per head, each node's top k log-probabilities (float32) and token ids (int64),
        parents in mixed-radix order (as `pick_candidates` takes them once on the host)."""
        return self._levels(state, token_ids, top_k_tokens_per_head, None)

    def _levels(
        self,
        state: torch.Tensor,
        token_ids: torch.Tensor,
        top_k_tokens_per_head: Sequence[int],
        budget: NodeBudget | None,
    ) -> list[Any]:  # `draft_levels`' tensors, or with `budget` its host arrays
        batch = state.shape[0]
        # The nodes to expand come in groups of siblings, which share their parent's state and
        # so its projection: G groups (at first the roots) of c tokens each, F = G * c nodes;
        # or, where a budget leaves some siblings out, F groups of one, each node's parent at
        # `parent_rows` of the projected states.
        parents = self.initial_state(state)  # [B * G, d]
        tokens = token_ids.view(batch, 1)  # [B * G, c]
        parent_rows: torch.Tensor | None = None  # [F]
        levels: list[tuple[torch.Tensor, torch.Tensor]] = []  # per head: [B * F, k] each
        fused = fused_kernels(state)
        vocabulary = self.draft_vocabulary
        for i, k in enumerate(top_k_tokens_per_head):
            last = i + 1 == len(top_k_tokens_per_head)
            if budget is not None and budget.expanded.size == 0:  # no node left worth drafting
                budget.add(np.empty((0, k), np.float32), np.empty((0, k), np.int64), last)
                continue
            projected = self.proj[i](parents)  # [B * G, d]
            if parent_rows is not None:
                projected = projected.index_select(0, parent_rows)  # [F, d]
            if fused is not None:
                norm = cast(SpeculatorNorm, self.ln[i])
                emb = cast(nn.Embedding, self.emb[i]).weight
                parents = fused.speculator_stage(
                    projected, tokens, emb, self.emb_scale, norm.weight, norm.bias, NORM_EPS
                )  # [B * F, d]
                top_logprobs, tokens = fused.log_softmax_topk(self.head[i](parents), k, vocabulary)
            else:
                parents = self._draft_stage(i, projected.unsqueeze(1), tokens)  # [B * F, d]
                logprobs = self.head[i](parents).float().log_softmax(-1)  # [B * F, vocab or V']
                top_logprobs, tokens = logprobs.topk(k, dim=-1)  # [B * F, k] each
                if vocabulary is not None:
                    tokens = vocabulary[tokens]
            if budget is None:
                levels.append((top_logprobs, tokens))
                continue
            rows = budget.add(top_logprobs.numpy(), tokens.numpy(), last)
            parent_rows = None if rows is None else torch.from_numpy(rows // k)
            if rows is not None:
                tokens = tokens.reshape(-1, 1)[torch.from_numpy(rows)]  # [F, 1]
        return levels if budget is None else budget.levels
