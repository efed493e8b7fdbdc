"""The step loop: schedule -> one forward pass -> sample -> update requests.

`LLMEngine` is synchronous and single-threaded: the offline API drives it directly and the server
runs it on its own thread, handing it new and cancelled requests between steps.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kv_cache import KVCacheManager
from engine.model_runner import ModelRunner, SequenceInput
from engine.request import Request
from engine.sampler import TokenLogprobs, make_generator, sample_with_details, token_logprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import RequestOutput, Scheduler, SchedulerConfig, SchedulerOutput


@dataclass(frozen=True)
class EngineOutput(RequestOutput):
    """A `RequestOutput` plus, when the request's params ask for `logprobs`, one
    `TokenLogprobs` per token of `new_token_ids`."""

    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    """With `SamplingParams.prompt_logprobs`, on the request's first output with tokens: the
    raw (unprocessed) details of prompt tokens 1 .. n-1, each given the tokens before it."""


class LLMEngine:
    """Owns the scheduler, the KV manager and the model runner; `step()` advances every
    scheduled request by one forward pass and returns what each request gained."""

    def __init__(
        self,
        runner: ModelRunner,
        scheduler_config: SchedulerConfig,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.runner = runner
        self.kv = KVCacheManager(runner.num_blocks, runner.block_size)
        self.scheduler = Scheduler(scheduler_config, self.kv)
        self.eos_token_ids = eos_token_ids
        self._generators: dict[str, torch.Generator | None] = {}
        self._logits: dict[str, list[torch.Tensor]] | None = None
        self._prompt_logprobs: dict[str, list[TokenLogprobs]] = {}

    def record_logits(self, enabled: bool) -> None:
        """Keep each sampled token's logits row (for tests against a reference model)."""
        self._logits = {} if enabled else None

    def pop_logits(self, request_id: str) -> list[torch.Tensor]:
        return [] if self._logits is None else self._logits.pop(request_id, [])

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        time_limit_s: float | None = None,
    ) -> None:
        now = time.monotonic()
        self.scheduler.add_request(
            Request(
                request_id,
                prompt_token_ids,
                params,
                arrival_time=now,
                deadline=None if time_limit_s is None else now + time_limit_s,
                eos_token_ids=self.eos_token_ids,
            )
        )
        self._generators[request_id] = make_generator(params)

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineOutput]:
        """Run one step. Returns the requests that gained tokens or finished, including those the
        scheduler finished without running (aborted, time limit, too long)."""
        sched = self.scheduler.schedule(time.monotonic())
        outputs = [EngineOutput(r.request_id, [], r.status) for r in sched.finished_requests]
        if sched.scheduled_requests:
            sampled, details = self._execute(sched)
            for out in self.scheduler.update_from_output(sched, sampled, time.monotonic()):
                lps = details.get(out.request_id)
                prompt_lps = None
                if out.new_token_ids and out.request_id in self._prompt_logprobs:
                    prompt_lps = self._prompt_logprobs.pop(out.request_id)
                outputs.append(
                    EngineOutput(
                        out.request_id,
                        out.new_token_ids,
                        out.status,
                        out.num_draft_tokens,
                        out.num_accepted_tokens,
                        None if lps is None else lps[: len(out.new_token_ids)],
                        prompt_lps,
                    )
                )
        for out in outputs:
            if out.finished:
                self._generators.pop(out.request_id, None)
                self._prompt_logprobs.pop(out.request_id, None)
        return outputs

    def _execute(
        self, sched: SchedulerOutput
    ) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprobs]]]:
        inputs: list[SequenceInput] = []
        sampling: list[Request] = []  # requests that reach their last known token this step
        sample_rows: list[int] = []  # their logits rows
        prompt_rows: list[tuple[Request, int, list[int]]] = []  # (request, first row, offsets)
        num_rows = 0
        for req in sched.scheduled_requests:
            n = sched.num_scheduled_tokens[req.request_id]
            start = req.num_computed_tokens
            token_ids = list(req.all_token_ids[start : start + n])
            completes = start + n >= req.num_tokens
            indices = self._prompt_logits_indices(req, start, n)
            if indices:
                prompt_rows.append((req, num_rows, [start + j + 1 for j in indices]))
            if completes:
                indices.append(n - 1)
                sampling.append(req)
                sample_rows.append(num_rows + len(indices) - 1)
            num_rows += len(indices)
            inputs.append(
                SequenceInput(
                    token_ids=token_ids,
                    num_computed_tokens=start,
                    block_table=self.kv.block_table(req.request_id),
                    logits_indices=indices,
                )
            )
        out = self.runner.execute(inputs)
        raw_logits = out.logits
        for req, row, positions in prompt_rows:
            self._record_prompt_logprobs(req, raw_logits[row : row + len(positions)], positions)
        if prompt_rows:
            raw_logits = raw_logits[torch.tensor(sample_rows, dtype=torch.int64)]
        logits = self._adjust_eos(raw_logits, sampling)
        token_ids, details = sample_with_details(
            logits,
            [r.sampling_params for r in sampling],
            [self._generators[r.request_id] for r in sampling],
            [
                r.all_token_ids if r.sampling_params.repetition_penalty != 1.0 else ()
                for r in sampling
            ],
        )
        if self._logits is not None:
            for i, req in enumerate(sampling):
                self._logits.setdefault(req.request_id, []).append(raw_logits[i].clone())
        sampled = {req.request_id: [t] for req, t in zip(sampling, token_ids, strict=True)}
        logprobs = {
            req.request_id: [d] for req, d in zip(sampling, details, strict=True) if d is not None
        }
        return sampled, logprobs

    def _prompt_logits_indices(self, req: Request, start: int, n: int) -> list[int]:
        """Chunk offsets whose logits score the next prompt token, for requests that want
        prompt logprobs and have not got them all yet (recomputation after preemption skips
        what was already recorded)."""
        if not req.sampling_params.prompt_logprobs or req.num_output_tokens:
            return []
        done = len(self._prompt_logprobs.get(req.request_id, []))
        last = req.num_prompt_tokens - 1  # positions 0 .. last-1 score tokens 1 .. last
        return [j for j in range(n) if done <= start + j < last]

    def _record_prompt_logprobs(
        self,
        req: Request,
        logits: torch.Tensor,  # [len(positions), vocab]: row i scores the token at positions[i]
        positions: list[int],
    ) -> None:
        recorded = self._prompt_logprobs.setdefault(req.request_id, [])
        top_n = req.sampling_params.top_n_tokens
        for row, position in enumerate(positions):
            if position == len(recorded) + 1:
                token = req.prompt_token_ids[position]
                recorded.append(token_logprobs(logits[row].float().cpu(), token, top_n))

    def _adjust_eos(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Before `min_new_tokens`, EOS cannot be chosen (TGIS's MinNewTokens processor); after
        it, a length penalty (start, decay) adds |eos| * (decay ** (generated - start) - 1) to
        each EOS score once more than `start` tokens were generated."""
        logits = self._suppress_early_eos(logits, reqs)
        cloned = False
        for i, r in enumerate(reqs):
            lp = r.sampling_params.length_penalty
            generated = r.num_output_tokens
            if lp is None or generated < r.sampling_params.min_new_tokens or generated <= lp[0]:
                continue
            if not cloned:
                logits, cloned = logits.clone(), True
            for eos in sorted(self.eos_token_ids):
                score = logits[i, eos]
                logits[i, eos] = score + score.abs() * (lp[1] ** (generated - lp[0]) - 1)
        return logits

    def _suppress_early_eos(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Before `min_new_tokens`, EOS cannot be chosen (TGIS's MinNewTokens processor)."""
        rows = [
            i
            for i, r in enumerate(reqs)
            if r.num_output_tokens < r.sampling_params.min_new_tokens
            and not r.sampling_params.ignore_eos
        ]
        if not rows or not self.eos_token_ids:
            return logits
        logits = logits.clone()
        eos = torch.tensor(sorted(self.eos_token_ids), device=logits.device)
        logits[torch.tensor(rows, device=logits.device)[:, None], eos] = float("-inf")
        return logits
