"""Prompt token details (`SamplingParams.prompt_logprobs`): the raw log-probabilities of prompt
tokens 1 .. n-1, each given the tokens before it, gathered chunk by chunk as the prompt is
computed and handed out with the request's first tokens."""

from __future__ import annotations

import torch

from engine.request import Request
from engine.sampling.sampler import TokenLogprobs, detail_tensor, details_of


class PromptLogprobs:
    """Per-request prompt token details, recorded in prompt order."""

    def __init__(self) -> None:
        self._recorded: dict[str, list[TokenLogprobs]] = {}

    def logits_indices(self, req: Request, start: int, n: int) -> list[int]:
        """Offsets within a chunk of `n` tokens from position `start` whose logits score the
        next prompt token, for requests that want prompt logprobs and have not got them all yet
        (recomputation after preemption skips what was already recorded)."""
        if not req.sampling_params.prompt_logprobs or req.num_output_tokens:
            return []
        done = len(self._recorded.get(req.request_id, []))
        last = req.num_prompt_tokens - 1  # positions 0 .. last-1 score tokens 1 .. last
        return [j for j in range(n) if done <= start + j < last]

    def record(
        self,
        req: Request,
        logits: torch.Tensor,  # [len(positions), vocab]: row i scores the token at positions[i]
        positions: list[int],
    ) -> None:
        """Record the details of the prompt tokens at `positions` not yet recorded. ValueError
        when a row holds NaN or +inf (the request cannot be given its details)."""
        if bool((logits.isnan() | logits.isposinf()).any()):
            raise ValueError("the model produced non-finite logits for this request's prompt")
        recorded = self._recorded.setdefault(req.request_id, [])
        top_n = req.sampling_params.top_n_tokens
        new: list[tuple[int, int]] = []  # (row, the prompt token it scores), in prompt order
        for row, position in enumerate(positions):
            if position == len(recorded) + len(new) + 1:
                new.append((row, req.prompt_token_ids[position]))
        if not new:
            return
        details = [detail_tensor(logits[row].float(), token, top_n) for row, token in new]
        flat = torch.stack(details).tolist()  # one copy to the host
        recorded += [details_of(token, d, top_n) for (_, token), d in zip(new, flat, strict=True)]

    def pop(self, request_id: str) -> list[TokenLogprobs] | None:
        """The request's details, once; None when none were recorded."""
        return self._recorded.pop(request_id, None)
