"""Token selection: argmax (greedy) or a draw keyed by (seed, position) (`keyed_draw`) from the
scores `logits_processor` makes, and the chosen tokens' details (`TokenLogprobs`: the
log-softmax of those processed scores)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.request import Request
from engine.sampling.batch_choice import finish, launch
from engine.sampling.choices import (
    Choices,
    ChoiceSteps,
    PendingChoices,
    TokenLogprobs,
    detail_tensor,
    details_of,
    read_choices,
)
from engine.sampling.greedy_choice import (
    greedy_choice_steps,
    greedy_choices,
    is_plain_greedy,
    masked_eos,
)
from engine.sampling.params import SamplingParams

__all__ = ["Choices", "PendingChoices", "Sampler", "TokenLogprobs", "detail_tensor",
           "details_of", "greedy_choices", "is_plain_greedy", "sample_with_details"]  # fmt: skip

CHUNK_ROWS = 32
"""Rows a CPU chooses at a time, under one intra-op thread (`torch.set_num_threads(1)` around
it, restored after, as the attention backend does for small work; `batch_choice.launch` gives
groups of rows to a second thread): their vocabulary-wide temporaries stay small enough to be
reused from the allocator instead of mapped afresh, and no operation waits for a pool thread on
a busy core."""


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
    rule of `logits_processor` (`process_eos` when `num_generated` is given, then
    `additive_penalties` when `generated_token_ids` is given, then `process_logits`) applied
    to all rows at once (`batch_rules`). A row fails alone, with an error and token -1,
    when its logits hold NaN or +inf or its scores are no longer a distribution; the other rows
    are unaffected.

    A sampled row's token is the keyed draw of its processed scores, so it depends on the seed
    and the position only. The batch costs one host-to-device copy (the rows' parameters) and
    one device-to-host copy (tokens, flags and details), unless a row's candidates cannot
    decide its rules (`Candidates.overflow`): such rows are chosen again among more candidates,
    at last the whole vocabulary. A CPU chooses `CHUNK_ROWS` rows at a time."""
    return read_choices(_choose(logits, params, seeds, positions, past_token_ids, num_generated,
                                eos_token_ids, False, generated_token_ids))  # fmt: skip


def _choose(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int | None],
    positions: Sequence[int],
    past_token_ids: Sequence[Sequence[int]],
    num_generated: Sequence[int] | None,
    eos_token_ids: Sequence[frozenset[int]] | None,
    row_tokens: bool,
    generated_token_ids: Sequence[Sequence[int]] | None,
) -> ChoiceSteps:
    """`sample_with_details` in two parts (`ChoiceSteps`); `row_tokens`: yield the rows' tokens
    on the device."""
    if logits.device.type != "cpu":
        launched = launch(logits, params, seeds, positions, past_token_ids, num_generated,
                           eos_token_ids, 0, row_tokens, generated_token_ids)  # fmt: skip
        values = torch.cat([t.flatten() for t in launched.parts]) if launched.parts else None
        read = yield launched.token_ids, values
        return finish(launched, read, params, seeds, positions, past_token_ids)
    starts = range(0, len(params), CHUNK_ROWS)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        chunks = [
            launch(logits[rows], params[rows], seeds[rows], positions[rows], past_token_ids[rows],
                    None if num_generated is None else num_generated[rows],
                    None if eos_token_ids is None else eos_token_ids[rows], 0, row_tokens,
                    None if generated_token_ids is None else generated_token_ids[rows], threads)
            for rows in (slice(i, i + CHUNK_ROWS) for i in starts)
        ]  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    parts = [t.flatten() for chunk in chunks for t in chunk.parts]
    tokens = [c.token_ids for c in chunks if c.token_ids is not None]
    read = yield (torch.cat(tokens) if tokens else None), (torch.cat(parts) if parts else None)
    torch.set_num_threads(1)
    try:
        choices = Choices([], [], [])
        offset = 0
        for i, chunk in zip(starts, chunks, strict=True):
            rows = slice(i, i + CHUNK_ROWS)
            size = sum(t.numel() for t in chunk.parts)
            part = finish(chunk, read[offset : offset + size], params[rows], seeds[rows],
                           positions[rows], past_token_ids[rows])  # fmt: skip
            offset += size
            choices.token_ids += part.token_ids
            choices.details += part.details
            choices.errors += part.errors
        return choices
    finally:
        torch.set_num_threads(threads)


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
        return read_choices(self._steps(logits, reqs, emitted, row_tokens=False))

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
    ) -> ChoiceSteps:
        params = [r.sampling_params for r in reqs]
        if all(map(is_plain_greedy, params)):
            return greedy_choice_steps(
                logits,
                [masked_eos(r, len(e)) for r, e in zip(reqs, emitted, strict=True)],
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
            row_tokens,
            [
                [*r.output_token_ids, *e] if p.has_additive_rules else ()
                for r, p, e in zip(reqs, params, emitted, strict=True)
            ],
        )
