"""Token selection from logits, in TGIS's (HF's) processing order.

Per row: repetition penalty over the request's prompt + output ids, then (sampling only)
temperature, top-k, top-p and typical-p; then argmax (greedy) or a seeded draw. Token details
(`TokenLogprobs`) are the log-softmax of these final processed scores. The caller applies the
min-new-tokens EOS mask and the length penalty before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

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


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A per-request generator, so a seeded request samples the same tokens in any batch."""
    if params.greedy:
        return None
    g = torch.Generator()
    if params.seed is None:
        g.seed()
    else:
        g.manual_seed(params.seed)
    return g


def sample_with_details(
    logits: torch.Tensor,  # [M, vocab] float32
    params: Sequence[SamplingParams],  # [M]
    generators: Sequence[torch.Generator | None],  # [M]
    past_token_ids: Sequence[Sequence[int]],  # [M]: prompt + output ids, for repetition_penalty
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """One token per row, plus its details for rows whose params ask for `logprobs`."""
    token_ids: list[int] = logits.argmax(dim=-1).tolist()
    details: list[TokenLogprobs | None] = [None] * len(params)
    for i, p in enumerate(params):
        if p.greedy and p.repetition_penalty == 1.0 and not p.logprobs:
            continue
        scores = process_logits(logits[i], p, past_token_ids[i])
        if p.greedy:
            token_ids[i] = int(scores.argmax().item())
        else:
            probs = scores.softmax(-1)
            token_ids[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
        if p.logprobs:
            details[i] = token_logprobs(scores, token_ids[i], p.top_n_tokens)
    return token_ids, details


def process_logits(
    logits: torch.Tensor,  # [vocab]
    p: SamplingParams,
    past_token_ids: Sequence[int],
) -> torch.Tensor:  # [vocab] float32 on CPU, -inf where filtered out
    scores = logits.float().cpu().clone()
    if p.repetition_penalty != 1.0 and past_token_ids:
        ids = torch.tensor(sorted(set(past_token_ids)), dtype=torch.int64)
        seen = scores[ids]
        rp = p.repetition_penalty
        scores[ids] = torch.where(seen < 0, seen * rp, seen / rp)
    if p.greedy:
        return scores
    scores = scores / p.temperature
    if 0 < p.top_k < scores.shape[-1]:
        kth = torch.topk(scores, p.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_scores, order = scores.sort(descending=True)
        probs = sorted_scores.softmax(-1)
        drop = probs.cumsum(-1) - probs >= p.top_p  # keep the token that crosses top_p
        scores[order[drop]] = float("-inf")
    if p.typical_p < 1.0:
        scores = _typical_filter(scores, p.typical_p)
    return scores


def _typical_filter(scores: torch.Tensor, mass: float) -> torch.Tensor:
    """HF's TypicalLogitsWarper: keep the tokens whose surprise is closest to the entropy, up to
    `mass` probability (at least one)."""
    logp = scores.log_softmax(-1)
    entropy = -(logp.exp() * logp).nansum()
    shifted = (-logp - entropy).abs()
    sorted_shifted, order = shifted.sort()
    cum = scores[order].softmax(-1).cumsum(-1)
    last = min(int((cum < mass).sum().item()), scores.shape[-1] - 1)
    remove = sorted_shifted > sorted_shifted[last]
    remove[0] = False
    return scores.index_fill(0, order[remove], float("-inf"))


def token_logprobs(
    scores: torch.Tensor,  # [vocab] processed scores
    token_id: int,
    top_n: int,
) -> TokenLogprobs:
    logp = scores.log_softmax(-1)
    rank = int((scores > scores[token_id]).sum().item()) + 1
    top_ids: tuple[int, ...] = ()
    top_lps: tuple[float, ...] = ()
    if top_n > 0:
        k = min(4 * top_n, scores.shape[-1])
        values, ids = torch.topk(scores, k)
        finite = values[torch.isfinite(values)]
        if finite.numel():
            nth = finite[min(top_n, finite.numel()) - 1]
            keep = (values >= nth) & torch.isfinite(values)
            pairs = sorted(
                zip(ids[keep].tolist(), logp[ids[keep]].tolist(), strict=True),
                key=lambda x: (-x[1], x[0]),
            )
            top_ids = tuple(i for i, _ in pairs)
            top_lps = tuple(lp for _, lp in pairs)
    return TokenLogprobs(token_id, float(logp[token_id].item()), rank, top_ids, top_lps)
