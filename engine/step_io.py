"""What one forward step of `engine.model_runner.ModelRunner` takes, a `SequenceInput` per
sequence, and returns, a `ModelOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SequenceInput:
    """One sequence's share of a forward step.

    `token_ids` are written to cache positions `num_computed_tokens + j`. Their RoPE positions are
    `positions` when given (draft trees: depth-based), else consecutive from
    `num_computed_tokens`. `logits_indices` picks which new tokens get logits and hidden states
    (default: the last one). `prefix_embeds` (prompt tuning) replace the embeddings of the first
    `len(prefix_embeds)` tokens, in the space of transformers' `inputs_embeds`. `argmax_only`:
    only the argmax of its rows is read, after any of `maskable_ids` are set to -inf; a step
    whose sequences all say so may get rows that are -inf away from the columns that can be the
    argmax (`LlamaModel.compute_logits`).
    """

    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    positions: list[int] | None = None
    tree_mask: torch.Tensor | None = None  # [len(token_ids), len(token_ids)] bool
    logits_indices: list[int] | None = None
    prefix_embeds: torch.Tensor | None = None  # [K <= len(token_ids), hidden], model dtype
    argmax_only: bool = False
    maskable_ids: frozenset[int] = frozenset()


@dataclass
class ModelOutput:
    """A step's results; the tensors may be a CUDA graph's static outputs, valid until the
    next `execute` (observers that keep rows copy them)."""

    logits: torch.Tensor  # [M, vocab] float32, rows in input order of the selected tokens
    hidden_states: torch.Tensor  # [M, hidden]: final-norm states at the same rows
    num_rows: list[int] = field(default_factory=list)  # rows per sequence
