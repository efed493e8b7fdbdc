"""One batch's choice of tokens under the sampling rules, in two parts: `launch` computes
every row's token, flags and details on the logits' device without reading them, `finish`
makes the `Choices` from those values read on the host (choosing again, among more candidates,
the rows whose candidates could not decide their rules)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import torch

from engine.host_copy import to_device
from engine.sampling.additive_penalties import apply_additive_penalties
from engine.sampling.batch_rules import (
    CANDIDATE_WIDTHS,
    StepParams,
    apply_eos_rules,
    filtered_candidates,
    penalised_scores,
)
from engine.sampling.choices import Choices, details_of
from engine.sampling.keyed_draw import keyed_sample_at, keyed_sample_rows, keys_of
from engine.sampling.logits_processor import sorted_logprobs
from engine.sampling.params import SamplingParams


def _groups(params: Sequence[SamplingParams], vocab: int, wide: int, cpu: bool) -> list[list[int]]:
    """The rows `_launch` processes (all but plain greedy ones): the greedy rows and the sampled
    rows by candidates: top-k, top-p, typical-p alone (on a CPU) and the whole vocabulary (every
    sampled row when `wide` is 2)."""
    groups: list[list[int]] = [[], [], [], [], []]
    for i, p in enumerate(params):
        if p.greedy and p.repetition_penalty == 1.0 and not p.logprobs:
            continue
        if p.greedy:
            kind = 0
        elif wide == 2:
            kind = 4
        elif 0 < p.top_k < vocab:
            kind = 1
        elif p.top_p < 1.0:
            kind = 2
        elif p.typical_p < 1.0 and cpu:
            kind = 3
        else:
            kind = 4
        groups[kind].append(i)
    return groups


@dataclass
class Launched:
    """One batch's choices computed, not yet read: `head` the host's part (on a CPU, the rows'
    argmax and flags), `parts` the tensors to read, `reads` what each holds (rows, detail
    width or -1, sampled), `logits` after the EOS and additive rules, `wide` the candidates'
    try, `token_ids` each row's token on the device (when asked for)."""

    head: list[float]
    parts: list[torch.Tensor]
    reads: list[tuple[list[int], int, bool]]
    logits: torch.Tensor
    wide: int
    token_ids: torch.Tensor | None


def launch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int | None],
    positions: Sequence[int],
    past_token_ids: Sequence[Sequence[int]],
    num_generated: Sequence[int] | None,
    eos_token_ids: Sequence[frozenset[int]] | None,
    wide: int,
    row_tokens: bool,
    generated_token_ids: Sequence[Sequence[int]] | None,
    threads: int = 1,
) -> Launched:
    """`sample_with_details`'s work on the device, with candidates of try `wide`
    (`CANDIDATE_WIDTHS`; 2: the whole vocabulary for every sampled row); `row_tokens`: each
    row's token on the device too; `threads`: the CPU threads the caller may use (a CPU batch
    of 8 rows or more gives groups of rows to a second thread when 2 or more)."""
    num_rows, vocab = len(params), logits.shape[-1]
    groups = _groups(params, vocab, wide, logits.device.type == "cpu")
    step = StepParams.build(params, seeds, positions, past_token_ids, num_generated,
                            eos_token_ids, groups, logits.device)  # fmt: skip
    if step.has_eos_rule:
        logits = apply_eos_rules(logits.clone(), step)
    if generated_token_ids is not None:
        logits = apply_additive_penalties(logits, params, generated_token_ids)
    # top-k rows pick their own width; the whole-vocabulary rows have none
    top_p, typical_p = (tries[min(wide, 1)] for tries in CANDIDATE_WIDTHS)
    widths = (vocab, top_p, typical_p, None)
    work = [
        (kind, rows, index)
        for kind, (rows, index) in enumerate(zip(groups, step.groups, strict=True))
        if rows
    ]
    theirs: dict[int, Future[_Group]] = {}
    if threads > 1 and not row_tokens and len(work) > 1 and num_rows >= 8:
        # the groups' vocabulary-wide operations release the GIL: two cores share them
        pool = _pool()
        for n in _halves([_GROUP_COST[kind] * len(rows) for kind, rows, _ in work]):
            theirs[n] = pool.submit(_alone, _choose_group, logits, params, step, *work[n],
                                    widths, None)  # fmt: skip
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
    mine = {
        n: _choose_group(logits, params, step, *w, widths, tokens_d)
        for n, w in enumerate(work)
        if n not in theirs
    }
    reads: list[tuple[list[int], int, bool]] = []  # rows, detail width, sampled
    for n in range(len(work)):
        group_parts, read = mine[n] if n in mine else theirs[n].result()
        parts += group_parts
        reads.append(read)
    return Launched(head, parts, reads, logits, wide, tokens_d)


_Group = tuple[list[torch.Tensor], tuple[list[int], int, bool]]
"""A group's tensors to read and what they hold (`Launched.reads`' entry)."""


def _choose_group(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    step: StepParams,
    kind: int,  # `_groups`' kind
    rows: list[int],
    index: torch.Tensor,  # `rows` on the device
    widths: tuple[int, int, int, int | None],  # candidates of kinds 1 to 4
    tokens_d: torch.Tensor | None,  # each row's token on the device, filled in (or None)
) -> _Group:
    """The tokens, flags and details of one `_groups` group of a `launch`."""
    every = len(rows) == logits.shape[0]
    sub = step if every else step.select(index)  # the rows' parameters
    scores = penalised_scores(logits, None if every else index, sub)
    if kind == 0:  # greedy
        tokens = scores.argmax(-1)
        parts = [tokens.double()]
        if tokens_d is not None:
            tokens_d.index_copy_(0, index, tokens)
        width = _top_width([params[i] for i in rows], logits.shape[-1])
        if width is not None:
            values, ids = scores.topk(width, -1)
            logp = scores.log_softmax(-1)
            parts.append(_details(scores, logp, tokens, values, ids, logp.gather(1, ids)))
        return parts, (rows, -1 if width is None else width, False)
    c = filtered_candidates(scores, sub, [params[i] for i in rows], widths[kind - 1])
    keys = keys_of(sub.rows[:, 6:9].long())
    if c.whole:
        drawn = keyed_sample_rows(c.scores, keys)
    else:
        drawn = keyed_sample_at(c.scores, c.token_ids, keys)
    tokens = c.token_ids.gather(1, drawn[:, None])[:, 0]
    if tokens_d is not None:
        tokens_d.index_copy_(0, index, tokens)
    # NaN (`amax` propagates it), an infinite maximum (+inf: overflow, -inf: nothing left):
    # no distribution
    invalid = ~c.scores.amax(-1).isfinite()
    parts = [tokens.double(), invalid.double(), c.overflow.double()]
    top = _top_width([params[i] for i in rows], c.scores.shape[1])
    if top is not None:
        logp = sorted_logprobs(c.scores)
        parts.append(
            _details(c.scores, logp, drawn, c.scores[:, :top], c.token_ids[:, :top],
                     logp[:, :top])
        )  # fmt: skip
    return parts, (rows, -1 if top is None else top, True)


_GROUP_COST = (1.0, 1.5, 2.7, 5.0, 5.0)
"""A row's relative cost on a CPU in each `_groups` kind (greedy, top-k, top-p, typical-p,
the whole vocabulary)."""


def _halves(costs: list[float]) -> set[int]:
    """The items to give a second thread so that both take about as long: the costliest
    first, each to the thread with less so far (the calling thread takes the first)."""
    given: set[int] = set()
    mine = theirs = 0.0
    for n in sorted(range(len(costs)), key=lambda n: -costs[n]):
        if mine <= theirs:
            mine += costs[n]
        else:
            theirs += costs[n]
            given.add(n)
    return given


def _alone(choose: Callable[..., _Group], *args: Any) -> _Group:
    """`choose(*args)` on a pool thread, under one intra-op thread as its caller is."""
    torch.set_num_threads(1)
    return choose(*args)


@cache
def _pool() -> ThreadPoolExecutor:
    """The one thread that chooses groups beside a CPU's calling thread."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="sampler")


def finish(
    launched: Launched,
    read: list[float],  # `launched.parts` read on the host
    params: Sequence[SamplingParams],
    seeds: Sequence[int | None],
    positions: Sequence[int],
    past_token_ids: Sequence[Sequence[int]],
) -> Choices:
    """The choices of a `_launch`ed batch; rows its candidates cannot decide are chosen again,
    among wider candidates."""
    num_rows = len(params)
    flat = launched.head + read
    choices = Choices([int(t) for t in flat[:num_rows]], [None] * num_rows, [None] * num_rows)
    flags = flat[num_rows : 2 * num_rows]
    no_distribution: set[int] = set()
    overflow: list[int] = []
    offset = 2 * num_rows
    for rows, width, sampled in launched.reads:
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
        _choose_again(choices, overflow, launched.logits, params, seeds, positions,
                      past_token_ids, launched.wide + 1)  # fmt: skip
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
    wide: int,
) -> None:
    """Choose `rows` again with candidates of try `wide`, into `choices`."""
    sub = logits[to_device(torch.tensor(rows), logits.device)]
    args = ([params[i] for i in rows], [seeds[i] for i in rows], [positions[i] for i in rows],
            [past_token_ids[i] for i in rows])  # fmt: skip
    launched = launch(sub, *args, None, None, wide, False, None)
    again = finish(launched, torch.cat([t.flatten() for t in launched.parts]).tolist(), *args)
    for n, i in enumerate(rows):
        choices.token_ids[i] = again.token_ids[n]
        choices.details[i] = again.details[n]
        choices.errors[i] = again.errors[n]
