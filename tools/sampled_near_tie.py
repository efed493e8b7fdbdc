"""The near-tie rule for comparing token choices: how close the runner-up came at a position.

Two runs of the same seeded requests (e.g. speculation on and off) must choose the same token ids;
the one allowed exception is a true near-tie, where floating-point order alone can flip a choice.
The engine's choice at a position is the argmax of a score row, so the measure is the gap between
the top two entries of that row, in the reference run's state at the first differing position:

    greedy row   the processed logits (`process_eos`, then `process_logits`: repetition penalty)
    sampled row  the processed scores (also temperature, top-k, top-p, typical-p) plus the keyed
                 Gumbel noise of (seed, position) from `engine.sampling.keyed_draw`

`choice_scores` rebuilds that row from the reference's raw logits row (as `LogitsRecorder`
records it) with the engine's own functions; `top2_gap` measures it. A difference whose gap is
below `NEAR_TIE` counts as a near-tie, any other as a real mismatch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sampling.keyed_draw import keyed_gumbel, row_keys
from engine.sampling.logits_processor import process_eos, process_logits
from engine.sampling.params import SamplingParams

NEAR_TIE = 1e-4
"""Top-2 gaps below this are near-ties: a different choice there is not a real mismatch."""


@dataclass(frozen=True)
class ChoiceState:
    """A request's state where a token is chosen: its params, its seed (the one the engine drew
    with; ignored for greedy params), the sequence position of the token (prompt length + tokens
    generated before it), the prompt + output ids before it and its EOS ids."""

    params: SamplingParams
    seed: int | None
    position: int
    past_token_ids: Sequence[int]
    num_generated: int
    eos_token_ids: frozenset[int]


@dataclass(frozen=True)
class Gap:
    """The top two entries of a choice's score row: `token` (the argmax, the engine's choice),
    `runner_up`, and `gap` (their score difference, >= 0; inf when only one token is left)."""

    token: int
    runner_up: int
    gap: float

    @property
    def near_tie(self) -> bool:
        return self.gap < NEAR_TIE


def choice_scores(raw_logits: torch.Tensor, state: ChoiceState) -> torch.Tensor:
    """[vocab] float32: the row whose argmax the engine takes for `state`, rebuilt from the raw
    (unprocessed) logits row `raw_logits` [vocab] that the model produced there."""
    logits = process_eos(
        raw_logits.float().reshape(1, -1),
        [state.params],
        [state.num_generated],
        [state.eos_token_ids],
    )[0]
    scores = process_logits(logits, state.params, state.past_token_ids)
    if state.params.greedy:
        return scores
    keys = row_keys([state.seed or 0], [state.position], scores.device)
    gumbel = keyed_gumbel(keys, scores.shape[-1])[0]
    return scores.float() + gumbel


def top2_gap(raw_logits: torch.Tensor, state: ChoiceState) -> Gap:
    """The top-2 gap of `choice_scores(raw_logits, state)`."""
    scores = choice_scores(raw_logits, state)
    values, ids = torch.topk(scores, 2)
    first, second = float(values[0]), float(values[1])
    gap = first - second if second != float("-inf") else float("inf")
    return Gap(int(ids[0]), int(ids[1]), gap)
