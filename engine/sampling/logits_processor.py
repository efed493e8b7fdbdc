"""TGIS's logit rules, all in one place, in TGIS's (HF's) order.

For a batch of rows (`process_eos`): before `min_new_tokens`, EOS cannot be chosen (TGIS's
MinNewTokens processor); after it, the length penalty raises the EOS scores. Then per row
(`process_logits`): repetition penalty over the request's prompt + output ids and, for sampling
only, temperature, top-k, top-p and typical-p. The sampler takes the argmax or a seeded draw of
the result, and reports token details from the same processed scores.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from engine.sampling.params import SamplingParams

MAX_SCORE = 1e30
"""Bound on the magnitude of a score a penalty produces (length or repetition penalty): far
above any logit, so the favoured token wins once a penalty grows that large, and low enough that
division by any temperature TGIS allows (>= 0.05) stays finite in float32."""


def process_eos(
    logits: torch.Tensor,  # [M, vocab]
    params: Sequence[SamplingParams],  # [M]
    num_generated: Sequence[int],  # [M]: tokens the row's request has generated before it
    eos_token_ids: Sequence[frozenset[int]],  # [M]: the row's request's EOS ids
) -> torch.Tensor:  # [M, vocab]; `logits` itself when no rule applies
    """Before `min_new_tokens` (unless `ignore_eos`), every EOS score becomes -inf. Afterwards,
    with a length penalty (start, decay), once more than `start` tokens were generated, each
    finite EOS score s becomes s + |s| * (decay ** (generated - start) - 1), computed in log
    space and clamped to +-`MAX_SCORE`, so no start or decay can overflow."""
    suppressed = [
        i
        for i, p in enumerate(params)
        if num_generated[i] < p.min_new_tokens and not p.ignore_eos and eos_token_ids[i]
    ]
    penalised = [
        i
        for i, p in enumerate(params)
        if p.length_penalty is not None
        and num_generated[i] >= p.min_new_tokens
        and num_generated[i] > p.length_penalty[0]
        and eos_token_ids[i]
    ]
    if not suppressed and not penalised:
        return logits
    logits = logits.clone()
    for i in suppressed:
        ids = torch.tensor(sorted(eos_token_ids[i]), device=logits.device)
        logits[i, ids] = float("-inf")
    for i in penalised:
        start, decay = params[i].length_penalty  # type: ignore[misc]
        factor = _eos_factor(decay, num_generated[i] - start)
        ids = torch.tensor(sorted(eos_token_ids[i]), device=logits.device)
        scores = logits[i, ids].double()
        penalised_scores = (scores + scores.abs() * (factor - 1)).clamp(-MAX_SCORE, MAX_SCORE)
        logits[i, ids] = torch.where(scores.isfinite(), penalised_scores, scores).to(logits.dtype)
    return logits


def _eos_factor(decay: float, exponent: int) -> float:
    """decay ** exponent, at most 2 * MAX_SCORE (beyond it the clamp decides anyway)."""
    if exponent * math.log(decay) >= math.log(2 * MAX_SCORE):
        return 2 * MAX_SCORE
    return float(decay**exponent)


def process_logits(
    logits: torch.Tensor,  # [vocab]
    p: SamplingParams,
    past_token_ids: Sequence[int],
) -> torch.Tensor:  # [vocab] float32 on the logits' device, -inf where filtered out
    """One row's repetition penalty (scores clamped to +-`MAX_SCORE`) and, for sampling only,
    temperature, top-k, top-p, typical-p: the per-row statement of the rules, which the batched
    `batch_rules` must match token for token. Top-p and typical-p work on the scores sorted
    descending, ties by token id (`top_p_drop`, `typical_drop`)."""
    scores = logits.float().clone()
    if p.repetition_penalty != 1.0 and past_token_ids:
        ids = torch.tensor(sorted(set(past_token_ids)), dtype=torch.int64, device=scores.device)
        seen = scores[ids]
        rp = p.repetition_penalty
        penalised = torch.where(seen < 0, seen * rp, seen / rp)
        scores[ids] = penalised.clamp(-MAX_SCORE, MAX_SCORE)
    if p.greedy:
        return scores
    scores = scores / p.temperature
    if 0 < p.top_k < scores.shape[-1]:
        kth = torch.topk(scores, p.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if p.top_p < 1.0 or p.typical_p < 1.0:
        sorted_scores, order = scores.sort(descending=True, stable=True)
        row = sorted_scores[None]  # [1, vocab]
        if p.top_p < 1.0:
            # without top-k the probabilities are normalised over the vocabulary in id order
            total = None if 0 < p.top_k < scores.shape[-1] else id_order_total(scores[None])
            row = row.masked_fill(top_p_drop(row, p.top_p, total), float("-inf"))
        if p.typical_p < 1.0:
            row = row.masked_fill(typical_drop(row, p.typical_p), float("-inf"))
        scores = torch.empty_like(scores).scatter_(0, order, row[0])
    return scores


def _normalised(
    scores: torch.Tensor,  # [M, C] sorted descending
    total: torch.Tensor | None = None,  # [M, 1] the normaliser (None: over these C, in order)
) -> tuple[torch.Tensor, torch.Tensor]:  # [M, C] probabilities, [M, C] log-probabilities
    """softmax and log_softmax of rows sorted descending, with their sum taken in order
    (`cumsum`), so that a row's leading values give the same results whatever -inf follow."""
    shifted = scores - scores[:, :1]
    e = shifted.exp()
    if total is None:
        total = e.cumsum(-1)[:, -1:]
    return e / total, shifted - total.log()


def sorted_logprobs(scores: torch.Tensor) -> torch.Tensor:  # [M, C]
    """Log-probabilities of rows of processed scores sorted descending (ties by token id)."""
    return _normalised(scores)[1]


def id_order_total(scores: torch.Tensor) -> torch.Tensor:  # [M, 1]
    """The sum of exp(score - row maximum) over rows [M, vocab] in token id order (`cumsum`:
    the same in any batch): top-p's normaliser when no top-k filtered the row."""
    return (scores - scores.amax(-1, keepdim=True)).exp().cumsum(-1)[:, -1:]


def top_p_drop(
    scores: torch.Tensor,  # [M, C] sorted descending, ties by token id
    top_p: float | torch.Tensor,  # a number, or [M, 1]
    total: torch.Tensor | None = None,  # [M, 1] `id_order_total` (None: over these C, in order)
) -> torch.Tensor:  # [M, C] bool
    """The tokens top-p drops: those whose better tokens already hold `top_p` of the
    probability (the token that crosses `top_p` is kept)."""
    probs = _normalised(scores)[0] if total is None else (scores - scores[:, :1]).exp() / total
    return probs.cumsum(-1) - probs >= top_p


def typical_drop(
    scores: torch.Tensor,  # [M, C] sorted descending, ties by token id
    mass: float | torch.Tensor,  # a number, or [M, 1]
) -> torch.Tensor:  # [M, C] bool
    """HF's TypicalLogitsWarper: keep the tokens whose surprise is closest to the entropy, up to
    `mass` probability (at least one); the others are dropped."""
    return typical_cut(scores, mass)[0]


def typical_cut(
    scores: torch.Tensor,  # [M, C] sorted descending, ties by token id
    mass: float | torch.Tensor,  # a number, or [M, 1]
    total: torch.Tensor | None = None,  # [M, 1] the softmax normaliser (None: over these C)
    entropy: torch.Tensor | None = None,  # [M, 1] the entropy (None: over these C, in order)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`typical_drop` [M, C], with what shows whether C leading candidates of a longer row
    decide it: the largest kept surprise distance [M, 1], the number of tokens whose cumulative
    probability (in distance order) stays below `mass` [M, 1], and the distances [M, C]."""
    probs, logp = _normalised(scores, total)
    if entropy is None:
        entropy = -torch.where(probs > 0, probs * logp, 0.0).cumsum(-1)[:, -1:]
    shifted = (-logp - entropy).abs()
    sorted_shifted, order = shifted.sort(dim=-1, stable=True)
    cum = probs.gather(1, order).cumsum(-1)
    below = (cum < mass).sum(-1, keepdim=True)
    cut = sorted_shifted.gather(1, below.clamp(max=scores.shape[-1] - 1))
    drop = (shifted > cut).scatter(1, order[:, :1], False)
    return drop, cut, below, shifted
