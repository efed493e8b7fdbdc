"""Observers of the rows the engine chooses tokens from: tests compare each token's logits with a
reference model, speculator training records the hidden states and teacher distributions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


class TokenObserver(Protocol):
    def on_logits(
        self,
        request_ids: Sequence[str],  # [M]
        logits: torch.Tensor,  # [M, vocab]: raw, before any logit rule
        hidden_states: torch.Tensor,  # [M, hidden]: the final-norm states they came from
        from_tree: bool,
    ) -> None:
        """Called each step with the rows the requests' tokens were chosen from: row i chose a
        token of `request_ids[i]`, rows of one request in its token order. `from_tree`: the
        rows are the walked nodes of draft trees (a request's last row is the node whose choice
        left the tree)."""
        ...


class LogitsRecorder:
    """Keeps every chosen token's raw logits row, per request."""

    def __init__(self) -> None:
        self.logits: dict[str, list[torch.Tensor]] = {}

    def on_logits(
        self,
        request_ids: Sequence[str],
        logits: torch.Tensor,
        hidden_states: torch.Tensor,
        from_tree: bool,
    ) -> None:
        for i, request_id in enumerate(request_ids):
            self.logits.setdefault(request_id, []).append(logits[i].clone())

    def pop(self, request_id: str) -> list[torch.Tensor]:
        """[vocab] per token, in order; [] when none were recorded."""
        return self.logits.pop(request_id, [])


@dataclass(frozen=True)
class StepStates:
    """What a request's plain steps computed for each token they sampled, in order: row n is the
    final-norm hidden state the n-th sampled token was drawn from (after reading the token
    before it) and the top-k of that row's raw next-token log-probabilities."""

    hidden_states: torch.Tensor  # [n, hidden] float32, CPU
    top_ids: torch.Tensor  # [n, k] int64
    top_logprobs: torch.Tensor  # [n, k] float32


class StateRecorder:
    """Keeps `StepStates` with the `top_k` log-probabilities of every token a plain step samples
    (not of tokens chosen along draft trees): the inputs and targets of speculator training."""

    def __init__(self, top_k: int) -> None:
        self.top_k = top_k
        self._parts: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}

    def on_logits(
        self,
        request_ids: Sequence[str],
        logits: torch.Tensor,
        hidden_states: torch.Tensor,
        from_tree: bool,
    ) -> None:
        if from_tree:
            return
        logits = logits.float()
        top, top_ids = logits.topk(self.top_k, dim=-1)
        top_logprobs = (top - logits.logsumexp(-1, keepdim=True)).cpu()
        hidden, top_ids = hidden_states.float().cpu(), top_ids.cpu()
        for i, request_id in enumerate(request_ids):
            self._parts.setdefault(request_id, []).append(
                (hidden[i : i + 1], top_ids[i : i + 1], top_logprobs[i : i + 1])
            )

    def pop(self, request_id: str) -> StepStates | None:
        """The request's recorded states, or None when none were recorded."""
        parts = self._parts.pop(request_id, None)
        if not parts:
            return None
        hidden, top_ids, top_logprobs = (torch.cat(t) for t in zip(*parts, strict=True))
        return StepStates(hidden, top_ids, top_logprobs)
