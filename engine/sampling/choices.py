"""A step's choices (`Choices`): one token per row, or the error that failed the row, and the
chosen token's details (`TokenLogprobs`) where asked for."""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from dataclasses import dataclass

import torch


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


ChoiceSteps = Generator[tuple[torch.Tensor | None, torch.Tensor | None], list[float], Choices]
"""A choice in two parts: it yields each row's token on the device (or None) and the float64
values the host needs (or None), is sent those values read on the host, and returns the
`Choices`."""


class PendingChoices:
    """A step's choices computed on the device, not yet read: `token_ids` [M] int64 on the
    device, when asked for, holds each row's token (meaningless for a row that fails; a row
    chosen again after the read may end with another); `values` the float64 values `finish`
    needs from the host (None: none), to be read in one copy with whatever else the step
    reads."""

    def __init__(self, steps: ChoiceSteps) -> None:
        self._steps = steps
        self.token_ids, self.values = next(steps)

    def finish(self, values: list[float]) -> Choices:
        """The choices, from `values` read on the host (empty when `values` is None)."""
        try:
            self._steps.send(values)
        except StopIteration as done:
            return done.value
        raise AssertionError("a choice reads the device once")


def read_choices(steps: ChoiceSteps) -> Choices:
    """`steps`' choices, their values read on the host right away."""
    pending = PendingChoices(steps)
    return pending.finish([] if pending.values is None else pending.values.tolist())


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
