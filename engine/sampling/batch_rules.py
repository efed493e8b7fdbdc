"""TGIS's logit rules for all of a step's rows at once (`logits_processor` states them per row).

The step's per-row parameters (temperatures, top-k, top-p, typical-p, penalties, EOS rules, draw
keys, the penalised ids) travel to the device in one copy (`StepParams`). The rules then run as
batched tensor operations, with no read back to the host. A sampled row is filtered in its
candidate space, the leading part of the order `process_logits` sorts into (descending, ties by
token id): with top-k, the k best tokens (and a few more, to see ties at the k-th score); with
top-p or typical-p, the best `CANDIDATE_WIDTHS`, kept only where they provably give the whole
vocabulary's result (`Candidates.overflow` marks the others, to be chosen again wider); with no
rule, the whole vocabulary unsorted. The keyed draw's noise is computed at the candidates only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.host_copy import to_device
from engine.kernels.selection import (
    divide_rows,
    plogp_sums_double,
    row_sums_double,
    top_candidates,
)
from engine.sampling.keyed_draw import key_parts
from engine.sampling.logits_processor import (
    MAX_SCORE,
    _eos_factor,
    id_order_total,
    top_p_drop,
    typical_cut,
)
from engine.sampling.params import SamplingParams

CANDIDATE_WIDTHS = ((256, 4096), (512, 4096))
"""Candidates of a row with no top-k, first and second try, with top-p and with typical-p alone
(whose typical set reaches further down a flat row than a nucleus): a row they do not decide
(`Candidates.overflow`) tries the next, then the whole vocabulary."""

TIE_MARGIN = 8
"""Candidates beyond the largest top-k: a row whose last candidate still ties its k-th score
may hold more tokens than its candidates (`Candidates.overflow`)."""

_NUM_COLUMNS = 11  # StepParams.rows' columns


@dataclass
class StepParams:
    """One step's rule parameters on the device, from one host-to-device copy.

    `rows` [R, 11] float64 for the R processed rows: logits row, temperature (1 for greedy),
    top_k, top_p, typical_p, repetition_penalty, the three `key_parts` and the length-penalty
    EOS mode (0 none, 1 -inf, 2 penalised) and factor; `penalised_ids` [R, L] the ids the
    repetition penalty reaches (padded with the row's first); `eos_ids` [R, E] the row's EOS ids
    (padded the same way)."""

    rows: torch.Tensor
    penalised_ids: torch.Tensor
    eos_ids: torch.Tensor
    groups: list[torch.Tensor]  # int64 index lists `build` was given, on the device
    has_eos_rule: bool

    @staticmethod
    def build(
        params: Sequence[SamplingParams],  # [R]
        seeds: Sequence[int | None],  # [R]
        positions: Sequence[int],  # [R]
        past_token_ids: Sequence[Sequence[int]],  # [R]
        num_generated: Sequence[int] | None,  # [R]; None: no EOS rule
        eos_token_ids: Sequence[frozenset[int]] | None,  # [R]
        groups: Sequence[Sequence[int]],  # index lists to carry along (e.g. row subsets)
        device: torch.device,
    ) -> StepParams:
        """The parameters of R rows (row i of the step's logits is row i here) in one copy."""
        num_rows = len(params)
        penalised = [
            sorted(set(past)) if p.repetition_penalty != 1.0 else []
            for p, past in zip(params, past_token_ids, strict=True)
        ]
        eos: list[list[int]] = []
        values: list[float] = []
        for i, p in enumerate(params):
            mode, factor, ids = 0, 1.0, []
            if num_generated is not None and eos_token_ids is not None and eos_token_ids[i]:
                n = num_generated[i]
                if n < p.min_new_tokens and not p.ignore_eos:
                    mode, ids = 1, sorted(eos_token_ids[i])
                elif (
                    p.length_penalty is not None
                    and n >= p.min_new_tokens
                    and n > p.length_penalty[0]
                ):
                    start, decay = p.length_penalty
                    mode, factor, ids = 2, _eos_factor(decay, n - start), sorted(eos_token_ids[i])
            eos.append(ids)
            values += [
                i, 1.0 if p.greedy else p.temperature, p.top_k, p.top_p,
                p.typical_p, p.repetition_penalty,
                *key_parts(seeds[i] or 0, positions[i]), mode, factor,
            ]  # fmt: skip
        width_l, width_e = max(map(len, penalised), default=0), max(map(len, eos), default=0)
        for ids in penalised:
            values += ids + [ids[0] if ids else 0] * (width_l - len(ids))
        for ids in eos:
            values += ids + [ids[0] if ids else 0] * (width_e - len(ids))
        for group in groups:
            values += group
        flat = to_device(torch.tensor(values, dtype=torch.float64), device)  # the step's one copy
        sizes = [num_rows * _NUM_COLUMNS, num_rows * width_l, num_rows * width_e]
        rows, penalised_ids, eos_ids, *group_ids = flat.split([*sizes, *map(len, groups)])
        return StepParams(
            rows.view(num_rows, _NUM_COLUMNS),
            penalised_ids.view(num_rows, width_l).long(),
            eos_ids.view(num_rows, width_e).long(),
            [g.long() for g in group_ids],
            any(eos),
        )

    def select(self, index: torch.Tensor) -> StepParams:
        """The parameters of the rows at `index` (int64, on the device)."""
        return StepParams(
            self.rows[index],
            self.penalised_ids[index],
            self.eos_ids[index],
            [],
            self.has_eos_rule,
        )

    def column(self, i: int) -> torch.Tensor:  # [R, 1] float32
        return self.rows[:, i : i + 1].float()


def apply_eos_rules(logits: torch.Tensor, step: StepParams) -> torch.Tensor:
    """`process_eos` on the step's rows [R, vocab], in place: before
    `min_new_tokens` every EOS score is -inf; with a length penalty due, each finite EOS score s
    becomes s + |s| * (factor - 1), in float64, clamped to +-`MAX_SCORE`."""
    if not step.has_eos_rule:
        return logits
    mode, factor = step.rows[:, 9:10], step.rows[:, 10:11]
    scores = logits.gather(1, step.eos_ids).double()
    penalised = (scores + scores.abs() * (factor - 1)).clamp(-MAX_SCORE, MAX_SCORE)
    penalised = torch.where(scores.isfinite(), penalised, scores)
    new = torch.where(mode == 2, penalised, scores)
    new = torch.where(mode == 1, -math.inf, new)
    return logits.scatter_(1, step.eos_ids, new.to(logits.dtype))


def penalised_scores(
    logits: torch.Tensor,  # [M, vocab] float32
    rows: torch.Tensor | None,  # [R] int64: the rows to process (None: all M, R = M)
    step: StepParams,  # the R rows' parameters
) -> torch.Tensor:  # [R, vocab] float32, a new tensor
    """The rows' repetition penalty (clamped to +-`MAX_SCORE`), then their temperature (a
    greedy row's is 1): each penalised score is computed from the raw one, as
    `process_logits` does, and written over the divided scores."""
    temperature = step.column(1)
    scores = divide_rows(logits, rows, temperature[:, 0])
    if scores is None:
        scores = logits / temperature if rows is None else logits[rows].div_(temperature)
    if step.penalised_ids.shape[1] > 0:
        if rows is None:
            rows = torch.arange(logits.shape[0], device=logits.device)
        rp = step.column(5)
        seen = logits[rows[:, None], step.penalised_ids]
        penalised = torch.where(seen < 0, seen * rp, seen / rp).clamp(-MAX_SCORE, MAX_SCORE)
        scores.scatter_(
            1, step.penalised_ids, torch.where(rp != 1.0, penalised, seen) / temperature
        )
    return scores


def _normalised_total(scores: torch.Tensor) -> torch.Tensor:  # [M, 1]
    """`top_p_drop`'s normaliser of rows sorted descending when given none."""
    return (scores - scores[:, :1]).exp().cumsum(-1)[:, -1:]


def _certain_sum(terms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 value [M, 1] of each row's float64 sum of `terms` [M, V] (all of one sign)
    taken in any order (a CPU `cumsum` accumulates float32 in float64), and whether it is
    certain [M, 1] (`_certain`)."""
    total = row_sums_double(terms)
    if total is None:
        total = terms.double().sum(-1, keepdim=True)
    return _certain(total, terms.shape[-1])


def _certain(total: torch.Tensor, num_terms: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`total` [M, 1], a float64 sum of `num_terms` float32 terms of one sign in some order,
    as float32, and whether that is certain: any two orders differ by at most
    2 (V - 1) 2**-53 |sum|, so the value is certain when both ends of that interval round to
    the same float32."""
    margin = total.abs() * (2.0 * num_terms * 2.0**-53 * 1.001)
    low, high = (total - margin).float(), (total + margin).float()
    return total.float(), low == high


def _vocabulary_sums(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`typical_cut`'s normaliser and entropy [M, 1] of whole rows [M, vocab] (the sums
    `process_logits` takes in descending order), without sorting, and whether both are certain
    [M, 1] (`_certain_sum`)."""
    shifted = scores - scores.amax(-1, keepdim=True)
    e = shifted.exp()
    total, certain = _certain_sum(e)
    sums = plogp_sums_double(shifted, e, total)
    if sums is not None:
        plogp, certain_h = _certain(sums, scores.shape[-1])
    else:
        probs, logp = e / total, shifted - total.log()
        plogp, certain_h = _certain_sum(torch.where(probs > 0, probs * logp, 0.0))
    return total, -plogp, certain & certain_h


def best_candidates(
    scores: torch.Tensor,  # [m, vocab]
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # [m, width] scores, [m, width] int64 token ids
    """The `width` best scores of each row sorted descending, ties by token id (among the
    chosen: the ids of a tie at the last score are any of the tied ones), and their ids."""
    if width * 64 <= scores.shape[-1]:
        best = top_candidates(scores, width)  # on a CPU: one pass per row, in this order
        if best is not None:
            return best
    if scores.device.type == "cpu" and width * 64 > scores.shape[-1]:
        # torch's top-k sorts the whole row for such widths: select with numpy instead
        raw = scores.numpy()
        ids = torch.from_numpy(np.argpartition(raw, -width, axis=1)[:, -width:])
    else:
        ids = scores.topk(width, -1).indices
    ids = ids.sort(-1).values
    values, by_value = scores.gather(1, ids).sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(1, by_value)


@dataclass
class Candidates:
    """Sampled rows' filtered scores [m, C] sorted descending (ties by token id, -inf where
    filtered out; in token id order when no row filters or asks for details), their token ids
    [m, C], and `overflow` [m]: the candidates may not decide the row's rules (ties at the k-th
    score, a nucleus or typical set reaching beyond them, a sum whose rounding depends on
    order); such a row must be chosen again among more candidates."""

    scores: torch.Tensor
    token_ids: torch.Tensor
    overflow: torch.Tensor
    whole: bool = False  # the rows' scores as they are: every token, in id order


def filtered_candidates(
    scores: torch.Tensor,  # [m, vocab] after temperature
    step: StepParams,  # the m rows' parameters
    params: Sequence[SamplingParams],  # [m]
    width: int | None,  # candidates per row; None: the whole vocabulary
) -> Candidates:
    """Top-k, top-p and typical-p of the rows, each rule only on rows that set it, among the
    rows' candidates: the best of their top-k (and `TIE_MARGIN` more) when every row has a
    top-k, else the best `width`, or the whole vocabulary. Rows given `width` candidates must
    all set top-k, or all set top-p, or all set typical-p alone (its normaliser and entropy
    are then summed over the whole row on a CPU, as `process_logits` sums them sorted)."""
    vocab = scores.shape[-1]
    with_top_k = [0 < p.top_k < vocab for p in params]
    if width is None and not any(any(with_top_k) or p.top_p < 1.0 or p.typical_p < 1.0
                                 or p.logprobs for p in params):  # fmt: skip
        # nothing filtered and no details: the scores as they are (the draw ignores the order)
        ids = torch.arange(vocab, device=scores.device).expand(scores.shape[0], vocab)
        no_overflow = torch.zeros(scores.shape[0], dtype=torch.bool, device=scores.device)
        return Candidates(scores, ids, no_overflow, whole=True)
    if width is None:
        values, ids = scores.sort(dim=-1, descending=True, stable=True)
    else:
        if all(with_top_k):
            width = max(p.top_k for p in params) + TIE_MARGIN
        values, ids = best_candidates(scores, min(vocab, width))
    overflow = torch.zeros(values.shape[0], dtype=torch.bool, device=values.device)
    partial = values.shape[1] < vocab
    sorted_values, last = values, values[:, -1:]  # no token beyond them scores above `last`
    if any(with_top_k):
        top_k = step.rows[:, 2:3].long()
        has_top_k = (top_k > 0) & (top_k < vocab)
        kth = values.gather(1, (top_k - 1).clamp(0, values.shape[1] - 1))
        kth = torch.where(has_top_k, kth, -math.inf)
        values = values.masked_fill(values < kth, -math.inf)
        if partial:
            overflow = has_top_k[:, 0] & (last[:, 0] >= kth[:, 0])
    if any(p.top_p < 1.0 for p in params):
        top_p = step.rows[:, 3:4]
        no_top_k = (step.rows[:, 2:3] <= 0) | (step.rows[:, 2:3] >= vocab)  # [m, 1]
        total = None
        if not all(with_top_k) and partial and scores.device.type == "cpu":
            shifted = scores - scores.amax(-1, keepdim=True)
            total, certain = _certain_sum(shifted.exp())  # `id_order_total`, where certain
            overflow = overflow | ~certain[:, 0]
        elif not all(with_top_k):
            total = id_order_total(scores)
            if any(with_top_k):
                total = torch.where(no_top_k, total, _normalised_total(values))
        drop = top_p_drop(values, top_p.float(), total) & (top_p < 1.0)
        values = values.masked_fill(drop, -math.inf)
        if partial and not all(with_top_k):
            # the nucleus must end before the tokens tied at the last score (which of those
            # are candidates is arbitrary): at the last candidate scoring above it
            above = (sorted_values > last).sum(-1, keepdim=True)
            ends = drop.gather(1, (above - 1).clamp(min=0)) & (above > 0)
            overflow = overflow | ~ends[:, 0]
    if any(p.typical_p < 1.0 for p in params):
        mass = step.rows[:, 4:5]
        if partial and not any(with_top_k) and all(p.top_p == 1.0 for p in params):
            total, entropy, certain = _vocabulary_sums(scores)
            drop, cut, below, shifted = typical_cut(values, mass.float(), total, entropy)
            # every token beyond the candidates is at least as far from the entropy as the
            # last candidate when its surprise is above the entropy
            surprise = total.log() - (last - values[:, :1])
            decided = certain & (below < values.shape[1]) & (cut < shifted[:, -1:])
            overflow = overflow | ~(decided & (surprise >= entropy))[:, 0]
        else:
            drop = typical_cut(values, mass.float())[0]
        values = values.masked_fill(drop & (mass < 1.0), -math.inf)
        if any(p.logprobs for p in params):  # typical-p may drop the best: sorted again
            values, order = values.sort(dim=-1, descending=True, stable=True)
            ids = ids.gather(1, order)
    return Candidates(values, ids, overflow)
