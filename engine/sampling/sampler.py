"""Token selection: argmax (greedy) or a draw keyed by (seed, position) (`keyed_draw`) from the
scores `logits_processor` makes, and the chosen tokens' details (`TokenLogprobs`: the
log-softmax of those processed scores)."""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.host_copy import to_device
from engine.request import Request
from engine.sampling.additive_penalties import apply_additive_penalties
from engine.sampling.batch_rules import (
    StepParams,
    apply_eos_rules,
    filtered_candidates,
    penalised_scores,
)
from engine.sampling.keyed_draw import keyed_sample_at, keys_of
from engine.sampling.logits_processor import sorted_logprobs
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


_Steps = Generator[tuple[torch.Tensor | None, torch.Tensor | None], list[float], Choices]
"""A choice in two parts: it yields each row's token on the device (or None) and the float64
values the host needs (or None), is sent those values read on the host, and returns the
`Choices`."""


class PendingChoices:
    """A step's choices computed on the device, not yet read: `token_ids` [M] int64 on the
    device, when asked for, holds each row's token (meaningless for a row that fails; a row
    chosen again after the read may end with another); `values` the float64 values `finish`
    needs from the host (None: none), to be read in one copy with whatever else the step
    reads."""

    def __init__(self, steps: _Steps) -> None:
        self._steps = steps
        self.token_ids, self.values = next(steps)

    def finish(self, values: list[float]) -> Choices:
        """The choices, from `values` read on the host (empty when `values` is None)."""
        try:
            self._steps.send(values)
        except StopIteration as done:
            return done.value
        raise AssertionError("a choice reads the device once")


def _read(steps: _Steps) -> Choices:
    pending = PendingChoices(steps)
    return pending.finish([] if pending.values is None else pending.values.tolist())


def sample_with_details(
    logits: torch.Tensor,  # [M, vocab] float32
    params: Sequence[SamplingParams],  # [M]
    seeds: Sequence[int | None],  # [M]: the request's seed (sampled rows)
    positions: Sequence[int],  # [M]: the sequence position of the token being chosen
    past_token_ids: Sequence[Sequence[int]],  # [M]: prompt + output ids, for repetition_penalty
    num_generated: Sequence[int] | None = None,  # [M]: for the EOS rules (None: no EOS rule)
    eos_token_ids: Sequence[frozenset[int]] | None = None,  # [M]
    generated_token_ids: Sequence[Sequence[int]] | None = None,  # [M]: None: no additive rule
) -> Choices:
    """One token per row, plus its details for rows whose params ask for `logprobs`: every
    rule of `logits_processor` (`process_eos` when `num_generated` is given, then the
    `additive_penalties` when `generated_token_ids` is given, then `process_logits`) applied
    to all rows at once (`batch_rules`). A row fails alone, with an error and token -1, when
    its logits hold NaN or +inf or its scores are no longer a distribution; the other rows are
    unaffected.

    A sampled row's token is the keyed draw of its processed scores, so it depends on the seed
    and the position only. The batch costs one host-to-device copy (the rows' parameters) and
    one device-to-host copy (tokens, flags and details), unless a row's top-k ties beyond its
    candidates: such rows are chosen again over the whole vocabulary."""
    return _read(_choose(logits, params, seeds, positions, past_token_ids, num_generated,
                         eos_token_ids, full=False, row_tokens=False,
                         generated_token_ids=generated_token_ids))  # fmt: skip


def _choose(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int | None],
    positions: Sequence[int],
    past_token_ids: Sequence[Sequence[int]],
    num_generated: Sequence[int] | None,
    eos_token_ids: Sequence[frozenset[int]] | None,
    full: bool,
    row_tokens: bool,
    generated_token_ids: Sequence[Sequence[int]] | None = None,
) -> _Steps:
    """`sample_with_details`; `full`: every sampled row's candidates are the whole vocabulary;
    `row_tokens`: yield the rows' tokens on the device (see `PendingChoices`)."""
    num_rows, vocab = len(params), logits.shape[-1]
    processed = [
        i for i, p in enumerate(params)
        if not (p.greedy and p.repetition_penalty == 1.0 and not p.logprobs)
    ]  # fmt: skip
    greedy = [j for j, i in enumerate(processed) if params[i].greedy]
    top_k = [
        j for j, i in enumerate(processed)
        if not params[i].greedy and 0 < params[i].top_k < vocab and not full
    ]  # fmt: skip
    nucleus = [
        j for j, i in enumerate(processed)
        if not params[i].greedy and j not in set(top_k) and params[i].top_p < 1.0 and not full
    ]  # fmt: skip
    whole = [
        j for j, i in enumerate(processed)
        if not params[i].greedy and j not in set(top_k) | set(nucleus)
    ]  # fmt: skip
    groups = [processed, greedy, top_k, nucleus, whole]
    step = StepParams.build(params, seeds, positions, past_token_ids, num_generated,
                            eos_token_ids, groups, logits.device)  # fmt: skip
    if step.has_eos_rule:
        logits = apply_eos_rules(logits.clone(), step)
    if generated_token_ids is not None:
        logits = apply_additive_penalties(logits, params, generated_token_ids)
    parts: list[torch.Tensor] = []
    if logits.device.type == "cpu":  # numpy's argmax: no wake-up of the intra-op thread pool
        raw = logits.numpy()
        index = raw.argmax(axis=1)  # [M]: the first NaN if any, else the first maximum
        values = raw[np.arange(num_rows), index]
        head = [*index.tolist(), *(np.isnan(values) | np.isposinf(values)).tolist()]
        tokens_d = torch.from_numpy(index.copy()) if row_tokens else None
    else:
        values_t, index_t = logits.max(dim=-1)  # NaN wins the max
        parts += [index_t.double(), (values_t.isnan() | values_t.isposinf()).double()]
        head = []
        tokens_d = index_t.clone() if row_tokens else None
    reads: list[tuple[list[int], int, bool]] = []  # rows, detail width, sampled
    if processed:
        every = len(processed) == num_rows
        rules = step if every else step.select(step.groups[0])  # [P] rows' parameters
        scores = penalised_scores(logits, None if every else step.groups[0], rules)
        if greedy:
            rows = [processed[j] for j in greedy]
            chosen = scores if len(greedy) == len(processed) else scores[step.groups[1]]
            tokens = chosen.argmax(-1)
            parts.append(tokens.double())
            if tokens_d is not None:
                at = (
                    step.groups[0]
                    if len(greedy) == len(processed)
                    else step.groups[0][step.groups[1]]
                )
                tokens_d.index_copy_(0, at, tokens)
            width = _top_width([params[i] for i in rows], vocab)
            if width is not None:
                values, ids = chosen.topk(width, -1)
                logp = chosen.log_softmax(-1)
                parts.append(_details(chosen, logp, tokens, values, ids, logp.gather(1, ids)))
            reads.append((rows, -1 if width is None else width, False))
        for group, index, candidates in (
            (top_k, step.groups[2], "top_k"),
            (nucleus, step.groups[3], "top_p"),
            (whole, step.groups[4], "all"),
        ):
            if not group:
                continue
            rows = [processed[j] for j in group]
            every = len(group) == len(processed)
            sub = rules if every else rules.select(index)
            c = filtered_candidates(
                scores if every else scores[index],
                sub,
                [params[i] for i in rows],
                candidates,
            )
            drawn = keyed_sample_at(c.scores, c.token_ids, keys_of(sub.rows[:, 6:9].long()))
            tokens = c.token_ids.gather(1, drawn[:, None])[:, 0]
            if tokens_d is not None:
                tokens_d.index_copy_(0, step.groups[0] if every else step.groups[0][index], tokens)
            # NaN, an infinite maximum (+inf: overflow, -inf: nothing left): no distribution
            invalid = c.scores.isnan().any(-1) | ~c.scores.amax(-1).isfinite()
            parts += [tokens.double(), invalid.double(), c.overflow.double()]
            width = _top_width([params[i] for i in rows], c.scores.shape[1])
            if width is not None:
                logp = sorted_logprobs(c.scores)
                parts.append(
                    _details(c.scores, logp, drawn, c.scores[:, :width], c.token_ids[:, :width],
                             logp[:, :width])
                )  # fmt: skip
            reads.append((rows, -1 if width is None else width, True))
    head += yield tokens_d, torch.cat([t.flatten() for t in parts]) if parts else None
    flat = head
    choices = Choices([int(t) for t in flat[:num_rows]], [None] * num_rows, [None] * num_rows)
    flags = flat[num_rows : 2 * num_rows]
    no_distribution: set[int] = set()
    overflow: list[int] = []
    offset = 2 * num_rows
    for rows, width, sampled in reads:
        m = len(rows)
        for i, token in zip(rows, flat[offset : offset + m], strict=True):
            choices.token_ids[i] = int(token)
        offset += m
        if sampled:
            no_distribution |= {
                i for i, f in zip(rows, flat[offset : offset + m], strict=True) if f
            }
            offset += m
            overflow += [i for i, f in zip(rows, flat[offset : offset + m], strict=True) if f]
            offset += m
        if width < 0:
            continue
        size = 2 + 3 * width
        for n, i in enumerate(rows):
            p = params[i]
            if p.logprobs:
                row = flat[offset + n * size : offset + (n + 1) * size]
                k = min(width, 4 * p.top_n_tokens if p.top_n_tokens > 0 else 0)
                read = [*row[:2], *row[2 : 2 + k], *row[2 + width : 2 + width + k],
                        *row[2 + 2 * width : 2 + 2 * width + k]]  # fmt: skip
                choices.details[i] = details_of(choices.token_ids[i], read, p.top_n_tokens)
        offset += m * size
    for i in range(num_rows):
        if flags[i]:
            choices.errors[i] = "the model produced non-finite logits for this request"
        elif i in no_distribution:
            choices.errors[i] = (
                "token selection failed: the processed scores are not a probability distribution"
            )
        if choices.errors[i] is not None:
            choices.token_ids[i], choices.details[i] = -1, None
    if overflow:
        _choose_again(choices, overflow, logits, params, seeds, positions, past_token_ids)
    return choices


def _top_width(params: Sequence[SamplingParams], num_candidates: int) -> int | None:
    """Columns of top tokens the rows' details need (None: no row asks for details)."""
    asking = [p for p in params if p.logprobs]
    if not asking:
        return None
    return min(num_candidates, max(4 * p.top_n_tokens for p in asking))


def _details(
    scores: torch.Tensor,  # [m, C]
    logp: torch.Tensor,  # [m, C]
    chosen: torch.Tensor,  # [m] column of the chosen token
    values: torch.Tensor,  # [m, K] top scores
    ids: torch.Tensor,  # [m, K] their token ids
    top_logp: torch.Tensor,  # [m, K] their logprobs
) -> torch.Tensor:  # [m, 2 + 3K] float64, `detail_tensor`'s layout per row
    column = chosen[:, None]
    rank = (scores > scores.gather(1, column)).sum(-1, keepdim=True)
    return torch.cat([logp.gather(1, column).double(), rank.double(), values.double(), ids.double(),
                      top_logp.double()], dim=1)  # fmt: skip


def _choose_again(
    choices: Choices,
    rows: list[int],
    logits: torch.Tensor,  # the step's logits after the EOS and additive rules
    params: Sequence[SamplingParams],
    seeds: Sequence[int | None],
    positions: Sequence[int],
    past_token_ids: Sequence[Sequence[int]],
) -> None:
    """Choose `rows` again with the whole vocabulary as candidates, into `choices`."""
    sub = logits[to_device(torch.tensor(rows), logits.device)]
    again = _read(_choose(sub, [params[i] for i in rows], [seeds[i] for i in rows],
                          [positions[i] for i in rows], [past_token_ids[i] for i in rows],
                          None, None, full=True, row_tokens=False))  # fmt: skip
    for n, i in enumerate(rows):
        choices.token_ids[i] = again.token_ids[n]
        choices.details[i] = again.details[n]
        choices.errors[i] = again.errors[n]


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


def greedy_choices(
    logits: torch.Tensor,  # [M, vocab] float32
    masked_ids: Sequence[frozenset[int]],  # [M]: ids scored -inf in that row (empty: none)
) -> Choices:
    """`sample_with_details` for rows of `is_plain_greedy` requests whose `process_eos` would
    only mask `masked_ids`: the same tokens and errors (the argmax, first index on ties; a row
    holding NaN or +inf after masking fails), from one reduction over the rows and one
    device-to-host copy (on a CPU, numpy on the calling thread). `logits` is not modified."""
    return _read(_greedy_choices(logits, masked_ids, row_tokens=False))


def _greedy_choices(
    logits: torch.Tensor, masked_ids: Sequence[frozenset[int]], row_tokens: bool
) -> _Steps:
    """`greedy_choices`; `row_tokens` as for `_choose`."""
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
            index = to_device(torch.tensor([rows, cols]), logits.device)  # the one such copy
            logits = logits.clone()
            logits[index[0], index[1]] = float("-inf")
        values_t, index_t = logits.max(dim=-1)  # [M] each: NaN wins the max
        flat = torch.cat([index_t.double(), (values_t.isnan() | values_t.isposinf()).double()])
        host = yield (index_t if row_tokens else None), flat
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
        return _read(self._steps(logits, reqs, emitted, row_tokens=False))

    def sample_on_device(
        self,
        logits: torch.Tensor,  # [M, vocab] raw
        reqs: Sequence[Request],  # [M]
        emitted: Sequence[Sequence[int]],  # [M]
        token_ids: bool = True,
    ) -> PendingChoices:
        """`sample`, up to the read: what the host reads for the rest and, with `token_ids`,
        each row's token on the device (see `PendingChoices`)."""
        return PendingChoices(self._steps(logits, reqs, emitted, row_tokens=token_ids))

    def _steps(
        self,
        logits: torch.Tensor,
        reqs: Sequence[Request],
        emitted: Sequence[Sequence[int]],
        row_tokens: bool,
    ) -> _Steps:
        params = [r.sampling_params for r in reqs]
        if all(map(is_plain_greedy, params)):
            return _greedy_choices(
                logits,
                [
                    r.eos_token_ids
                    if r.num_output_tokens + len(e) < p.min_new_tokens and not p.ignore_eos
                    else frozenset()
                    for r, p, e in zip(reqs, params, emitted, strict=True)
                ],
                row_tokens,
            )
        return _choose(
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
            [r.num_output_tokens + len(e) for r, e in zip(reqs, emitted, strict=True)],
            [r.eos_token_ids for r in reqs],
            full=False,
            row_tokens=row_tokens,
            generated_token_ids=[
                [*r.output_token_ids, *e] if p.has_additive_rules else ()
                for r, p, e in zip(reqs, params, emitted, strict=True)
            ],
        )
