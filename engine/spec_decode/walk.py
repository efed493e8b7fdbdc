"""A step's token choices: at every choice row at once, or lazily along the draft trees' walks.

Both give the same choice at every node a walk reaches: a node's choice depends only on its
logits row, its request's params and seed, its position and the drafts on its path, never on
the other rows chosen with it. So `Verification.walk` gains the same tokens, details and errors
either way; the lazy walk leaves the nodes no walk reaches unchosen (token -1, no details, no
error), and the walk never reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.sampling.choices import Choices, ChoiceSteps, PendingChoices
from engine.sampling.sampler import Sampler

if TYPE_CHECKING:
    from engine.batch import StepBatch
    from engine.spec_decode.verifier import Verification


def chooses_lazily(device: torch.device, row_tokens: bool) -> bool:
    """Whether a step on `device` chooses its tree nodes level by level along the walks.

    On a device (CUDA) it does not: a token is chosen at every node of every tree at once and
    read with the rest of the step, because a level-by-level walk would cost a read of the
    device per tree level while every node's choice costs only a few batched kernels; drafting
    on the device (`row_tokens`) also needs every node's token there. On a CPU there is no read
    to save and each chosen row costs real time (the sampling rules over the vocabulary), so the
    walk chooses only the nodes it reaches: usually the root and one or two more per tree."""
    return device.type == "cpu" and not row_tokens


def choose_tokens(
    sampler: Sampler,
    logits: torch.Tensor,  # [rows, vocab]: the step's logits
    rows_index: Callable[[list[int]], slice | torch.Tensor],  # rows -> an index of `logits`
    batch: StepBatch,
    row_tokens: bool,  # the drafter drafts on the device from every row's token
) -> PendingChoices | None:
    """The choice at each of `batch`'s choice rows (`chooses_lazily`: only the rows the walks
    reach), up to the step's read; None when the batch has no choice rows."""
    if not batch.choice_rows:
        return None
    if not chooses_lazily(logits.device, row_tokens):
        rows = logits[rows_index(batch.choice_rows)]
        return sampler.sample_on_device(
            rows, batch.choice_requests, batch.choice_emitted, token_ids=row_tokens
        )
    return PendingChoices(_read(walked_choices(sampler, logits, batch)))


def walked_choices(sampler: Sampler, logits: torch.Tensor, batch: StepBatch) -> Choices:
    """The choices at `batch`'s rows outside trees and at the tree nodes the walks reach,
    chosen level by level: one sampler call for those rows and every tree's root, then one per
    tree level for the children holding their parents' choices. A walk ends at a node whose
    choice no child holds, or fails."""
    num_choices = len(batch.choice_rows)
    choices = Choices([-1] * num_choices, [None] * num_choices, [None] * num_choices)
    walking: dict[int, Verification] = {v.first_choice: v for v in batch.verifying}
    level = [i for _, i in batch.sampling] + list(walking)
    while level:
        chosen = sampler.sample(
            _rows(logits, [batch.choice_rows[i] for i in level]),
            [batch.choice_requests[i] for i in level],
            [batch.choice_emitted[i] for i in level],
        )
        next_level = []
        for n, i in enumerate(level):
            token, error = chosen.token_ids[n], chosen.errors[n]
            choices.token_ids[i], choices.details[i], choices.errors[i] = (
                token, chosen.details[n], error
            )  # fmt: skip
            v = walking.pop(i, None)
            if v is None or error is not None:
                continue
            child = v.tree.child(i - v.first_choice, token)
            if child is not None:
                walking[v.first_choice + child] = v
                next_level.append(v.first_choice + child)
        level = next_level
    return choices


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """`logits[rows]`, a view where the rows are consecutive (a batch without trees)."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return logits[rows[0] : rows[0] + len(rows)]
    return logits[rows]


def _read(choices: Choices) -> ChoiceSteps:
    """Choices already on the host, as `ChoiceSteps` that read nothing."""
    yield None, None
    return choices
