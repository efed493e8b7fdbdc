"""Greedy rows served without the sampling rules: the argmax of the raw logits, EOS masked
before `min_new_tokens`, in one reduction and one device-to-host copy."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.sampling.choices import Choices
from engine.sampling.params import SamplingParams


def is_plain_greedy(params: SamplingParams) -> bool:
    """Whether a row's token is the argmax of its raw logits, EOS masked before
    `min_new_tokens` and nothing else applied: greedy, no repetition or length penalty, no
    logprobs (`greedy_choices` serves such rows)."""
    return (
        params.greedy
        and params.repetition_penalty == 1.0
        and params.length_penalty is None
        and not params.logprobs
    )


def greedy_choices(
    logits: torch.Tensor,  # [M, vocab] float32
    masked_ids: Sequence[frozenset[int]],  # [M]: ids scored -inf in that row (empty: none)
) -> Choices:
    """`sample_with_details` for rows of `is_plain_greedy` requests whose `process_eos` would
    only mask `masked_ids`: the same tokens and errors (the argmax, first index on ties; a row
    holding NaN or +inf after masking fails), from one reduction over the rows and one
    device-to-host copy (on a CPU, numpy on the calling thread). `logits` is not modified."""
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
    else:
        rows = [i for i, ids in enumerate(masked_ids) for _ in ids]
        cols = [t for ids in masked_ids for t in sorted(ids)]
        if rows:
            masked = torch.tensor([rows, cols], dtype=torch.int64)
            if logits.device.type == "cuda":
                masked = masked.pin_memory()
            index = masked.to(logits.device, non_blocking=True)  # the one host-to-device copy
            logits = logits.clone()
            logits[index[0], index[1]] = float("-inf")
        values_t, index_t = logits.max(dim=-1)  # [M] each: NaN wins the max
        flat = torch.cat([index_t.double(), (values_t.isnan() | values_t.isposinf()).double()])
        host = flat.tolist()  # the one copy to the host
        tokens, bad = [int(t) for t in host[:num_rows]], host[num_rows:]
    choices = Choices(tokens, [None] * num_rows, [None] * num_rows)
    for i in range(num_rows):
        if bad[i]:
            choices.token_ids[i], choices.errors[i] = -1, error
    return choices
