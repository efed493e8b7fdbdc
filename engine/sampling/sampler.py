"""Token selection: argmax (greedy) or a seeded draw from the scores `logits_processor` makes,
and the chosen tokens' details (`TokenLogprobs`: the log-softmax of those processed scores)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.request import Request
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


def make_generator(
    params: SamplingParams, device: torch.device | str = "cpu"
) -> torch.Generator | None:
    """A per-request generator on the logits' device, so a seeded request samples the same
    tokens in any batch."""
    if params.greedy:
        return None
    g = torch.Generator(device=device)
    if params.seed is None:
        g.seed()
    else:
        g.manual_seed(params.seed)
    return g


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
    generators: Sequence[torch.Generator | None],  # [M]
    past_token_ids: Sequence[Sequence[int]],  # [M]: prompt + output ids, for repetition_penalty
) -> Choices:
    """One token per row, plus its details for rows whose params ask for `logprobs`. A row fails
    alone, with an error and token -1, when its logits hold NaN or +inf or its own rules fail
    (e.g. a draw from scores that are no longer a distribution); the other rows are unaffected."""
    num_rows = len(params)
    bad = logits.isnan().any(-1) | logits.isposinf().any(-1)  # [M]
    token_ids, bad_rows = torch.stack([logits.argmax(dim=-1), bad.long()]).tolist()
    choices = Choices(token_ids, [None] * num_rows, [None] * num_rows)
    for i, p in enumerate(params):
        if bad_rows[i]:
            choices.token_ids[i] = -1
            choices.errors[i] = "the model produced non-finite logits for this request"
            continue
        if p.greedy and p.repetition_penalty == 1.0 and not p.logprobs:
            continue
        try:
            choices.token_ids[i], choices.details[i] = _choose_row(
                logits[i], p, generators[i], past_token_ids[i]
            )
        except (RuntimeError, ValueError, OverflowError) as e:
            choices.token_ids[i] = -1
            choices.errors[i] = f"token selection failed: {e}"
    return choices


def _choose_row(
    logits: torch.Tensor,  # [vocab]
    p: SamplingParams,
    generator: torch.Generator | None,
    past_token_ids: Sequence[int],
) -> tuple[int, TokenLogprobs | None]:
    scores = process_logits(logits, p, past_token_ids)
    if p.greedy:
        token_id = int(scores.argmax().item())
    else:
        probs = scores.softmax(-1)
        if not bool(probs.isfinite().all()):  # on CUDA, multinomial would assert on the device
            raise ValueError("the processed scores are not a probability distribution")
        token_id = int(torch.multinomial(probs, 1, generator=generator).item())
    return token_id, token_logprobs(scores, token_id, p.top_n_tokens) if p.logprobs else None


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


class Sampler:
    """Chooses one token per logits row for live requests: TGIS's rules (`logits_processor`),
    then argmax or a draw from the request's own seeded generator, so a seeded request samples
    the same tokens in any batch."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        """`device`: where the logits rows are (the model's device)."""
        self.device = device
        self._generators: dict[str, torch.Generator | None] = {}

    def add_request(self, request_id: str, params: SamplingParams) -> None:
        self._generators[request_id] = make_generator(params, self.device)

    def remove_request(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

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
        logits = process_eos(
            logits,
            params,
            [r.num_output_tokens + len(e) for r, e in zip(reqs, emitted, strict=True)],
            [r.eos_token_ids for r in reqs],
        )
        return sample_with_details(
            logits,
            params,
            [self._generators[r.request_id] for r in reqs],
            [
                [*r.all_token_ids, *e] if r.sampling_params.repetition_penalty != 1.0 else ()
                for r, e in zip(reqs, emitted, strict=True)
            ],
        )
