"""The per-row statement of token selection, the oracle of the batched sampler: each row on its
own through `process_eos`, OpenAI's additive rules (`additive_rules`, stated here on their own)
and `process_logits`, a keyed draw over the whole vocabulary, and the chosen token's details
from the whole vocabulary."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampling.keyed_draw import keyed_sample
from engine.sampling.logits_processor import process_eos, process_logits, sorted_logprobs
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import Choices, detail_tensor, details_of


def choices_row_by_row(
    logits: torch.Tensor,  # [M, vocab]
    params: Sequence[SamplingParams],
    seeds: Sequence[int | None],
    positions: Sequence[int],
    past_token_ids: Sequence[Sequence[int]],
    num_generated: Sequence[int],
    eos_token_ids: Sequence[frozenset[int]],
    generated_token_ids: Sequence[Sequence[int]] | None = None,
) -> Choices:
    """`sample_with_details`, one row at a time."""
    logits = process_eos(logits, params, num_generated, eos_token_ids)
    choices = Choices([], [], [])
    for i, p in enumerate(params):
        row = logits[i]
        if generated_token_ids is not None:
            row = additive_rules(row, p, generated_token_ids[i])
        if bool(row.isnan().any() | row.isposinf().any()):
            choices.token_ids.append(-1)
            choices.details.append(None)
            choices.errors.append("the model produced non-finite logits for this request")
            continue
        scores = process_logits(row, p, past_token_ids[i])
        if p.greedy:
            token = int(scores.argmax())
            flat = detail_tensor(scores, token, p.top_n_tokens).tolist()
        else:
            if bool(scores.isnan().any()) or not bool(scores.max().isfinite()):
                choices.token_ids.append(-1)
                choices.details.append(None)
                choices.errors.append(
                    "token selection failed: the processed scores are not a probability "
                    "distribution"
                )
                continue
            token = int(keyed_sample(scores[None], [seeds[i] or 0], [positions[i]])[0])
            ordered, order = scores.sort(descending=True, stable=True)
            logp = sorted_logprobs(ordered[None])[0]
            column = int((order == token).nonzero()[0, 0])
            k = min(4 * p.top_n_tokens, scores.shape[-1]) if p.top_n_tokens > 0 else 0
            head = [float(logp[column]), float((scores > scores[token]).sum())]
            flat = [*head, *ordered[:k].tolist(), *order[:k].tolist(), *logp[:k].tolist()]
        choices.token_ids.append(token)
        choices.details.append(details_of(token, flat, p.top_n_tokens) if p.logprobs else None)
        choices.errors.append(None)
    return choices


def additive_rules(
    row: torch.Tensor,  # [vocab]
    p: SamplingParams,
    generated_token_ids: Sequence[int],
) -> torch.Tensor:  # [vocab], a new tensor
    """OpenAI's rules on one row: token t's logit gains its `logit_bias` and loses
    frequency_penalty * count(t) + presence_penalty * (count(t) > 0), count(t) being its number
    of occurrences among the generated tokens; the amount is a float64 sum (bias, then
    frequency, then presence) rounded to the row's dtype before it is added."""
    row = row.clone()
    bias = p.logit_bias or {}
    counts: dict[int, int] = {}
    if p.presence_penalty != 0 or p.frequency_penalty != 0:
        for t in generated_token_ids:
            counts[t] = counts.get(t, 0) + 1
    for t in set(bias) | set(counts):
        count = counts.get(t, 0)
        delta = bias.get(t, 0.0) - p.frequency_penalty * count - p.presence_penalty * (count > 0)
        row[t] = row[t] + torch.tensor(delta, dtype=torch.float64).to(row.dtype)
    return row
