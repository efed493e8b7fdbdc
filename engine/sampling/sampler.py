"""Token selection: argmax (greedy) or a draw keyed by (seed, position) (`keyed_draw`) from the
scores `logits_processor` makes, and the chosen tokens' details (`TokenLogprobs`: the
log-softmax of those processed scores)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.request import Request
from engine.sampling.keyed_draw import keyed_sample
from engine.sampling.logits_processor import process_eos, process_logits
from engine.sampling.params import SamplingParams


@dataclass(frozen=True)
class TokenLogprobs:
    """Details of one chosen token: its logprob, its 1-based rank (1 + the number of tokens
    with a strictly greater processed score) and the top candidates, sorted by logprob
    descending (ties: lower id first): every token scoring at least the n-th highest finite
    score, capped at 4n."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass
class Choices:
    """One step's choice for each of M rows: the token (-1 where it failed), its details when
    the row's params ask for `logprobs`, and the error that failed the row (None when chosen)."""

    token_ids: list[int]  # [M]
    details: list[TokenLogprobs | None]  # [M]
    errors: list[str | None]  # [M]


def sample_with_details(
    logits: torch.Tensor,  # [M, vocab] float32
    params: Sequence[SamplingParams],  # [M]
    seeds: Sequence[int | None],  # [M]: the request's seed (sampled rows)
    positions: Sequence[int],  # [M]: the sequence position of the token being chosen
    past_token_ids: Sequence[Sequence[int]],  # [M]: prompt + output ids, for repetition_penalty
) -> Choices:
    """One token per row, plus its details for rows whose params ask for `logprobs`. A row fails
    alone, with an error and token -1, when its logits hold NaN or +inf or its own rules fail
    (e.g. a draw from scores that are no longer a distribution); the other rows are unaffected.

    A sampled row's token is `keyed_sample` of its processed scores, so it depends on the seed
    and the position only. The batch costs one device-to-host copy: tokens, flags and details
    are read together."""
    num_rows = len(params)
    bad = logits.isnan().any(-1) | logits.isposinf().any(-1)  # [M]
    errors: list[str | None] = [None] * num_rows
    scores: dict[int, torch.Tensor] = {}  # row -> [vocab] processed scores
    for i, p in enumerate(params):
        if p.greedy and p.repetition_penalty == 1.0 and not p.logprobs:
            continue
        try:
            scores[i] = process_logits(logits[i], p, past_token_ids[i])
        except (RuntimeError, ValueError, OverflowError) as e:
            errors[i] = f"token selection failed: {e}"
    tokens = {i: s.argmax() for i, s in scores.items() if params[i].greedy}
    sampled = [i for i in scores if not params[i].greedy]
    no_distribution = torch.zeros(num_rows, dtype=torch.bool, device=logits.device)
    if sampled:
        stacked = torch.stack([scores[i] for i in sampled])  # [m, vocab]
        drawn = keyed_sample(
            stacked, [seeds[i] or 0 for i in sampled], [positions[i] for i in sampled]
        )
        tokens |= dict(zip(sampled, drawn.unbind(), strict=True))
        # NaN, an infinite maximum (+inf: overflow, -inf: nothing left): no distribution
        invalid = stacked.isnan().any(-1) | ~stacked.amax(-1).isfinite()  # [m]
        index = torch.tensor(sampled, device=logits.device)
        no_distribution = no_distribution.index_copy(0, index, invalid)
    parts = [logits.argmax(dim=-1).double(), bad.double(), no_distribution.double()]
    lengths: dict[int, int] = {}
    for i in scores:
        parts.append(tokens[i].double().reshape(1))
        lengths[i] = 0
        if params[i].logprobs:
            parts.append(detail_tensor(scores[i], tokens[i], params[i].top_n_tokens))
            lengths[i] = parts[-1].numel()
    flat = torch.cat(parts).tolist()  # the one copy to the host
    choices = Choices([int(t) for t in flat[:num_rows]], [None] * num_rows, errors)
    offset = 3 * num_rows
    for i, size in lengths.items():
        choices.token_ids[i] = int(flat[offset])
        if params[i].logprobs:
            read = flat[offset + 1 : offset + 1 + size]
            choices.details[i] = details_of(choices.token_ids[i], read, params[i].top_n_tokens)
        offset += 1 + size
    for i in range(num_rows):
        if flat[num_rows + i]:
            choices.errors[i] = "the model produced non-finite logits for this request"
        elif flat[2 * num_rows + i]:
            choices.errors[i] = (
                "token selection failed: the processed scores are not a probability distribution"
            )
        if choices.errors[i] is not None:
            choices.token_ids[i], choices.details[i] = -1, None
    return choices


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
            logits = logits.clone()
            logits[torch.tensor(rows), torch.tensor(cols)] = float("-inf")
        values_t, index_t = logits.max(dim=-1)  # [M] each: NaN wins the max
        flat = torch.cat([index_t.double(), (values_t.isnan() | values_t.isposinf()).double()])
        host = flat.tolist()  # the one copy to the host
        tokens, bad = [int(t) for t in host[:num_rows]], host[num_rows:]
    choices = Choices(tokens, [None] * num_rows, [None] * num_rows)
    for i in range(num_rows):
        if bad[i]:
            choices.token_ids[i], choices.errors[i] = -1, error
    return choices


def detail_tensor(
    scores: torch.Tensor,  # [vocab] processed scores
    token: torch.Tensor | int,  # the chosen token, [] on the scores' device or an int
    top_n: int,
) -> torch.Tensor:  # float64 [2 + 3k]: logprob, rank - 1, k top scores, their ids, logprobs
    """A chosen token's details on the device, for `details_of` to read once on the host; k is
    min(4 * top_n, vocab), 0 without top_n."""
    logp = scores.log_softmax(-1)
    k = min(4 * top_n, scores.shape[-1]) if top_n > 0 else 0
    values, ids = torch.topk(scores, k)
    head = torch.stack([logp[token].double(), (scores > scores[token]).sum().double()])
    return torch.cat([head, values.double(), ids.double(), logp[ids].double()])


def details_of(token_id: int, flat: Sequence[float], top_n: int) -> TokenLogprobs:
    """`TokenLogprobs` from a `detail_tensor` read on the host."""
    k = (len(flat) - 2) // 3
    values, ids, logps = flat[2 : 2 + k], flat[2 + k : 2 + 2 * k], flat[2 + 2 * k :]
    finite = [v for v in values if math.isfinite(v)]
    top: list[tuple[int, float]] = []
    if top_n > 0 and finite:
        nth = finite[min(top_n, len(finite)) - 1]
        top = sorted(
            ((int(i), lp) for v, i, lp in zip(values, ids, logps, strict=True)
             if math.isfinite(v) and v >= nth),
            key=lambda x: (-x[1], x[0]),
        )  # fmt: skip
    return TokenLogprobs(
        token_id,
        flat[0],
        int(flat[1]) + 1,
        tuple(i for i, _ in top),
        tuple(lp for _, lp in top),
    )


class Sampler:
    """Chooses one token per logits row for live requests: TGIS's rules (`logits_processor`),
    then argmax or a draw keyed by the request's seed and the token's position, so a seeded
    request samples the same tokens in any batch, in a plain step or at a draft tree's node.
    A sampling request's seed is its params' (the engine gives one to requests without)."""

    def sample(
        self,
        logits: torch.Tensor,  # [M, vocab] raw
        reqs: Sequence[Request],  # [M]
        emitted: Sequence[Sequence[int]],  # [M]: tokens chosen for the row's request this step
    ) -> Choices:
        """One token per row, as if the row's request already held `emitted[i]` after its own
        tokens (a draft path being verified), plus its details when its params ask for them;
        a row whose choice fails carries its error instead (see `sample_with_details`)."""
        params = [r.sampling_params for r in reqs]
        if all(map(is_plain_greedy, params)):
            return greedy_choices(
                logits,
                [
                    r.eos_token_ids
                    if r.num_output_tokens + len(e) < p.min_new_tokens and not p.ignore_eos
                    else frozenset()
                    for r, p, e in zip(reqs, params, emitted, strict=True)
                ],
            )
        logits = process_eos(
            logits,
            params,
            [r.num_output_tokens + len(e) for r, e in zip(reqs, emitted, strict=True)],
            [r.eos_token_ids for r in reqs],
        )
        return sample_with_details(
            logits,
            params,
            [p.seed for p in params],
            [r.num_tokens + len(e) for r, e in zip(reqs, emitted, strict=True)],
            [
                [*r.all_token_ids[r.num_prefix_tokens :], *e]
                if r.sampling_params.repetition_penalty != 1.0
                else ()
                for r, e in zip(reqs, emitted, strict=True)
            ],
        )
