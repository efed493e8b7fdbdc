"""OpenAI's additive logit rules (`logit_bias`, `presence_penalty`, `frequency_penalty`) for all
of a step's rows at once.

For a row and a token t, with count the number of times t occurs among the row's generated
tokens (the prompt is not counted; at a draft tree's node, the drafts on the path to it are):

    delta = logit_bias[t] - frequency_penalty * count - presence_penalty * (count > 0)

evaluated left to right in float64 (an absent bias is 0), rounded to the logits' dtype and added
to the logit. Only tokens with a bias or a count change.

The sampler applies these rules after the EOS rules (`min_new_tokens`, length penalty) and
before TGIS's rules (repetition penalty, temperature, top-k, top-p, typical-p), which see the
adjusted logits as if the model had produced them: with `repetition_penalty` set as well, the
repetition penalty scales the adjusted logit.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.host_copy import to_device
from engine.sampling.params import SamplingParams


@dataclass
class AdditivePenalties:
    """One step's additive adjustments on the device, from one host-to-device copy:
    `token_ids` [R, W] the ids each row adjusts (padded with id 0 and delta 0) and `deltas`
    [R, W] float64 what is added to their logits."""

    token_ids: torch.Tensor
    deltas: torch.Tensor

    @staticmethod
    def build(
        params: Sequence[SamplingParams],  # [R]
        generated_token_ids: Sequence[Sequence[int]],  # [R]: each row's generated ids
        device: torch.device,
    ) -> AdditivePenalties | None:
        """The adjustments of R rows (row i of the step's logits is row i here); None when no
        row has additive rules. The host counts each row's tokens; the device computes the
        deltas."""
        if not any(p.has_additive_rules for p in params):
            return None
        columns: list[tuple[list[int], list[int], list[float]]] = []
        for p, generated in zip(params, generated_token_ids, strict=True):
            counted = p.presence_penalty != 0 or p.frequency_penalty != 0
            counts = Counter(generated) if counted else Counter[int]()
            bias = p.logit_bias or {}
            ids = sorted(counts.keys() | bias.keys())
            columns.append((ids, [counts[t] for t in ids], [bias.get(t, 0.0) for t in ids]))
        num_rows, width = len(params), max(len(ids) for ids, _, _ in columns)
        values: list[float] = []
        for p in params:
            values += [p.presence_penalty, p.frequency_penalty]
        for part in range(3):
            for column in columns:
                values += column[part]
                values += [0] * (width - len(column[part]))
        flat = to_device(torch.tensor(values, dtype=torch.float64), device)
        rows, ids, counts, bias = flat.split([2 * num_rows, *[num_rows * width] * 3])
        rows, counts = rows.view(num_rows, 2), counts.view(num_rows, width)
        presence, frequency = rows[:, 0:1], rows[:, 1:2]
        deltas = bias.view(num_rows, width) - frequency * counts - presence * (counts > 0)
        return AdditivePenalties(ids.view(num_rows, width).long(), deltas)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:  # [R, vocab], a new tensor
        """`logits` [R, vocab] with each row's deltas added at its ids."""
        return logits.clone().scatter_add_(1, self.token_ids, self.deltas.to(logits.dtype))


def apply_additive_penalties(
    logits: torch.Tensor,  # [R, vocab]
    params: Sequence[SamplingParams],  # [R]
    generated_token_ids: Sequence[Sequence[int]],  # [R]
) -> torch.Tensor:  # [R, vocab]: `logits` itself when no row has additive rules, else a new one
    """The rows' additive rules (`logit_bias`, `presence_penalty`, `frequency_penalty`)."""
    penalties = AdditivePenalties.build(params, generated_token_ids, logits.device)
    return logits if penalties is None else penalties.apply(logits)
