"""Greedy rows served without the sampling rules: the argmax of the raw logits, EOS masked
before `min_new_tokens`, in one reduction and one device-to-host copy."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.host_copy import to_device
from engine.request import Request
from engine.sampling.choices import Choices, ChoiceSteps, read_choices
from engine.sampling.params import SamplingParams


def is_plain_greedy(params: SamplingParams) -> bool:
    """Whether a row's token is the argmax of its raw logits, EOS masked before
    `min_new_tokens` and nothing else applied: greedy, no repetition or length penalty, no
    additive rule, no logprobs (`greedy_choices` serves such rows)."""
    return (
        params.greedy
        and params.repetition_penalty == 1.0
        and params.length_penalty is None
        and not params.logprobs
        and not params.has_additive_rules
    )


def masked_eos(request: Request, num_emitted: int) -> frozenset[int]:
    """The EOS ids `process_eos` scores -inf in a row of `request` chosen after `num_emitted`
    tokens of its step: all of them before `min_new_tokens` (unless `ignore_eos`), else none."""
    params = request.sampling_params
    if request.num_output_tokens + num_emitted < params.min_new_tokens and not params.ignore_eos:
        return request.eos_token_ids
    return frozenset()


def greedy_choices(
    logits: torch.Tensor,  # [M, vocab] float32
    masked_ids: Sequence[frozenset[int]],  # [M]: ids scored -inf in that row (empty: none)
) -> Choices:
    """`sample_with_details` for rows of `is_plain_greedy` requests whose `process_eos` would
    only mask `masked_ids`: the same tokens and errors (the argmax, first index on ties; a row
    holding NaN or +inf after masking fails), from one reduction over the rows and one
    device-to-host copy (on a CPU, numpy on the calling thread). `logits` is not modified."""
    return read_choices(greedy_choice_steps(logits, masked_ids, row_tokens=False))


def greedy_choice_steps(
    logits: torch.Tensor, masked_ids: Sequence[frozenset[int]], row_tokens: bool
) -> ChoiceSteps:
    """`greedy_choices` in two parts (`ChoiceSteps`); `row_tokens`: yield the rows' tokens on
    the device."""
    num_rows = logits.shape[0]
    error = "the model produced non-finite logits for this request"
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        # numpy's argmax runs on the calling thread: a torch reduction over a vocabulary-wide
        # row wakes the intra-op thread pool, which costs more than the reduction on few rows.
        scores = logits.numpy()  # [M, vocab], shares memory with `logits`
        index = scores.argmax(axis=1)  # [M]: the first NaN if any, else the first maximum
        # Masking only lowers scores, so it changes a row's choice only where that choice is a
        # masked id: only such rows are chosen again, from a masked copy.
        for i, ids in enumerate(masked_ids):
            if ids and int(index[i]) in ids:
                row = scores[i].copy()  # [vocab]
                row[list(ids)] = -np.inf
                index[i] = row.argmax()
        values = scores[np.arange(num_rows), index]  # [M]: never at a masked id
        flags = np.isnan(values) | np.isposinf(values)  # [M]
        tokens, bad = index.tolist(), flags.tolist()
        yield (torch.from_numpy(index) if row_tokens else None), None
    else:
        rows = [i for i, ids in enumerate(masked_ids) for _ in ids]
        cols = [t for ids in masked_ids for t in sorted(ids)]
        if rows:
            index_d = to_device(torch.tensor([rows, cols]), logits.device)  # the one such copy
            logits = logits.clone()
            logits[index_d[0], index_d[1]] = float("-inf")
        values_t, index_t = logits.max(dim=-1)  # [M] each: NaN wins the max
        flat = torch.cat([index_t.double(), (values_t.isnan() | values_t.isposinf()).double()])
        host = yield (index_t if row_tokens else None), flat
        tokens, bad = [int(t) for t in host[:num_rows]], host[num_rows:]
    choices = Choices(tokens, [None] * num_rows, [None] * num_rows)
    for i in range(num_rows):
        if bad[i]:
            choices.token_ids[i], choices.errors[i] = -1, error
    return choices
