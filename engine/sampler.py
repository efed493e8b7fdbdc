"""Token selection from logits: greedy argmax, or seeded sampling with top-k / top-p."""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


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


def sample(
    logits: torch.Tensor,  # [M, vocab] float32
    params: list[SamplingParams],  # [M]
    generators: list[torch.Generator | None],  # [M]
) -> list[int]:
    greedy_ids = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            greedy_ids[i] = _sample_row(logits[i], p, generators[i])
    return greedy_ids


def _sample_row(
    logits: torch.Tensor,  # [vocab]
    p: SamplingParams,
    generator: torch.Generator | None,
) -> int:
    scores = logits.float().cpu() / p.temperature
    if 0 < p.top_k < scores.shape[-1]:
        kth = torch.topk(scores, p.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_scores, order = scores.sort(descending=True)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        drop = cum - sorted_scores.softmax(-1) >= p.top_p  # keep the token that crosses top_p
        scores[order[drop]] = float("-inf")
    probs = scores.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
