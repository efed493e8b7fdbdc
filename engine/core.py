"""The step loop: schedule -> one forward pass -> sample -> update requests.

`LLMEngine` is synchronous and single-threaded: the offline API drives it directly and the server
runs it on its own thread, handing it new and cancelled requests between steps.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.kv_cache import KVCacheManager
from engine.model_runner import ModelRunner, SequenceInput
from engine.request import Request
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import (
    TokenLogprobs,
    make_generator,
    sample_with_details,
    token_logprobs,
)
from engine.scheduler import RequestOutput, Scheduler, SchedulerConfig, SchedulerOutput
from engine.spec_decode.policy import SpeculationPolicy
from engine.spec_decode.proposer import ProposalInput, Proposer
from engine.spec_decode.tree import DraftTree


@dataclass(frozen=True)
class EngineOutput(RequestOutput):
    """A `RequestOutput` plus, when the request's params ask for `logprobs`, one
    `TokenLogprobs` per token of `new_token_ids`."""

    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    """With `SamplingParams.prompt_logprobs`, on the request's first output with tokens: the
    raw (unprocessed) details of prompt tokens 1 .. n-1, each given the tokens before it."""
    draft_depth: int = 0
    """The longest path of the draft tree verified this step (0: no speculation); the request
    gained `num_accepted_tokens` of those drafts plus one token of its own."""


@dataclass(frozen=True)
class StepStates:
    """What a request's plain steps computed for each token they sampled, in order: row n is the
    final-norm hidden state the n-th sampled token was drawn from (after reading the token
    before it) and the top-k of that row's raw next-token log-probabilities."""

    hidden_states: torch.Tensor  # [n, hidden] float32, CPU
    top_ids: torch.Tensor  # [n, k] int64
    top_logprobs: torch.Tensor  # [n, k] float32


@dataclass
class _Verification:
    """A draft tree being verified: the request, its tree, its first logits row, and the
    accepted walk so far (`node`, emitted tokens and their details)."""

    request: Request
    tree: DraftTree
    first_row: int
    node: int = 0
    token_ids: list[int] = field(default_factory=list)
    details: list[TokenLogprobs | None] = field(default_factory=list)


class LLMEngine:
    """Owns the scheduler, the KV manager and the model runner; `step()` advances every
    scheduled request by one forward pass and returns what each request gained.

    With a `proposer`, every greedy request drafts a token tree after each step while at most
    `spec_max_batch_size` requests run, and the next step verifies it in the same forward pass
    as everything else: the request gains the longest draft path equal to its own choices plus
    one token, exactly the tokens it would have produced one by one (every per-token rule:
    min_new_tokens, penalties, logprobs, stops, is applied along the path).
    """

    def __init__(
        self,
        runner: ModelRunner,
        scheduler_config: SchedulerConfig,
        eos_token_ids: frozenset[int],
        proposer: Proposer | None = None,
        spec_max_batch_size: int = 16,
        policy: SpeculationPolicy | None = None,
        enable_prefix_caching: bool = True,
    ) -> None:
        """Without a `policy` every speculating request verifies the proposer's whole tree;
        with one, the policy picks per step how many candidates pay (possibly none). With
        `enable_prefix_caching`, requests share the KV blocks of identical prompt prefixes."""
        self.runner = runner
        self.kv = KVCacheManager(runner.num_blocks, runner.block_size, enable_prefix_caching)
        self.scheduler = Scheduler(scheduler_config, self.kv)
        self.eos_token_ids = eos_token_ids
        self.proposer = proposer
        self.spec_max_batch_size = spec_max_batch_size
        self.policy = policy
        self._propose_seconds = 0.0  # drafting for the coming step, part of its cost
        self._trees: dict[str, DraftTree] = {}  # proposed for the next step
        self._hidden_states: dict[str, torch.Tensor] = {}  # [hidden] where the last token came
        self._generators: dict[str, torch.Generator | None] = {}
        self._logits: dict[str, list[torch.Tensor]] | None = None
        self._states_top_k = 0
        self._states: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self._prompt_logprobs: dict[str, list[TokenLogprobs]] = {}

    def record_logits(self, enabled: bool) -> None:
        """Keep each sampled token's logits row (for tests against a reference model)."""
        self._logits = {} if enabled else None

    def pop_logits(self, request_id: str) -> list[torch.Tensor]:
        return [] if self._logits is None else self._logits.pop(request_id, [])

    def record_states(self, top_k: int) -> None:
        """Keep `StepStates` with the `top_k` log-probabilities (0: stop keeping them) for every
        token a plain step samples (not for tokens accepted from draft trees): the inputs and
        targets of speculator training."""
        self._states_top_k = top_k
        self._states = {}

    def pop_states(self, request_id: str) -> StepStates | None:
        """The request's recorded states, or None when none were recorded."""
        parts = self._states.pop(request_id, None)
        if not parts:
            return None
        hidden, top_ids, top_logprobs = (torch.cat(t) for t in zip(*parts, strict=True))
        return StepStates(hidden, top_ids, top_logprobs)

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
        start = time.perf_counter()
        sched = self.scheduler.schedule(time.monotonic())
        outputs = [EngineOutput(r.request_id, [], r.status) for r in sched.finished_requests]
        if sched.scheduled_requests:
            sampled, details, depths = self._execute(sched)
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
                        depths.get(out.request_id, 0),
                    )
                )
        for out in outputs:
            if out.finished:
                self._generators.pop(out.request_id, None)
                self._prompt_logprobs.pop(out.request_id, None)
        if self.policy is not None and sched.scheduled_requests:
            seconds = time.perf_counter() - start + self._propose_seconds
            self.policy.observe_step(
                sched.total_num_scheduled_tokens, seconds, len(sched.scheduled_spec_token_ids)
            )
        start = time.perf_counter()
        self._propose()
        self._propose_seconds = time.perf_counter() - start
        return outputs

    def _execute(
        self, sched: SchedulerOutput
    ) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprobs]], dict[str, int]]:
        """Run the model; returns each completing request's new tokens, their details (when
        asked for) and, for verified trees, the tree depth."""
        trees, self._trees = self._trees, {}
        self._hidden_states = {}
        inputs: list[SequenceInput] = []
        sampling: list[Request] = []  # requests that reach their last known token, no drafts
        sample_rows: list[int] = []  # their logits rows
        verifying: list[_Verification] = []
        prompt_rows: list[tuple[Request, int, list[int]]] = []  # (request, first row, offsets)
        num_rows = 0
        for req in sched.scheduled_requests:
            n = sched.num_scheduled_tokens[req.request_id]
            start = req.num_computed_tokens
            drafts = sched.scheduled_spec_token_ids.get(req.request_id)
            if drafts:
                tree = trees[req.request_id].truncate(len(drafts))
                verifying.append(_Verification(req, tree, num_rows))
                num_rows += n
                inputs.append(
                    SequenceInput(
                        token_ids=[req.all_token_ids[start], *drafts],
                        num_computed_tokens=start,
                        block_table=self.kv.block_table(req.request_id),
                        positions=[start + d for d in tree.depths],
                        tree_mask=tree.attention_mask(),
                        logits_indices=list(range(n)),
                    )
                )
                continue
            indices = self._prompt_logits_indices(req, start, n)
            if indices:
                prompt_rows.append((req, num_rows, [start + j + 1 for j in indices]))
            if start + n >= req.num_tokens:
                indices.append(n - 1)
                sampling.append(req)
                sample_rows.append(num_rows + len(indices) - 1)
            num_rows += len(indices)
            inputs.append(
                SequenceInput(
                    token_ids=list(req.all_token_ids[start : start + n]),
                    num_computed_tokens=start,
                    block_table=self.kv.block_table(req.request_id),
                    logits_indices=indices,
                )
            )
        out = self.runner.execute(inputs)
        for req, row, positions in prompt_rows:
            self._record_prompt_logprobs(req, out.logits[row : row + len(positions)], positions)
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprobs]] = {}
        if sampling:
            rows = torch.tensor(sample_rows, dtype=torch.int64)
            logits = out.logits.index_select(0, rows)
            if self._states_top_k:
                self._record_states(sampling, out.hidden_states.index_select(0, rows), logits)
            token_ids, details = self._sample(logits, sampling, [[] for _ in sampling])
            picked = zip(sampling, sample_rows, token_ids, details, strict=True)
            for req, row, token, detail in picked:
                sampled[req.request_id] = [token]
                if detail is not None:
                    logprobs[req.request_id] = [detail]
                self._hidden_states[req.request_id] = out.hidden_states[row]
        depths: dict[str, int] = {}
        if verifying:
            self._verify(verifying, out.logits, out.hidden_states)
            for v in verifying:
                request_id = v.request.request_id
                sampled[request_id] = v.token_ids
                if v.request.sampling_params.logprobs:
                    logprobs[request_id] = [d for d in v.details if d is not None]
                depths[request_id] = v.tree.depth
        return sampled, logprobs, depths

    def _record_states(
        self,
        reqs: list[Request],
        hidden_states: torch.Tensor,  # [len(reqs), hidden]
        logits: torch.Tensor,  # [len(reqs), vocab], raw
    ) -> None:
        logits = logits.float()
        top, top_ids = logits.topk(self._states_top_k, dim=-1)
        top_logprobs = (top - logits.logsumexp(-1, keepdim=True)).cpu()
        hidden, top_ids = hidden_states.float().cpu(), top_ids.cpu()
        for i, req in enumerate(reqs):
            self._states.setdefault(req.request_id, []).append(
                (hidden[i : i + 1], top_ids[i : i + 1], top_logprobs[i : i + 1])
            )

    def _sample(
        self, logits: torch.Tensor, reqs: list[Request], emitted: list[list[int]]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """One token per row of `logits` [len(reqs), vocab] for requests that already emitted
        `emitted[i]` more tokens than they hold (a path being verified)."""
        num_generated = [r.num_output_tokens + len(e) for r, e in zip(reqs, emitted, strict=True)]
        if self._logits is not None:
            for i, req in enumerate(reqs):
                self._logits.setdefault(req.request_id, []).append(logits[i].clone())
        return sample_with_details(
            self._adjust_eos(logits, reqs, num_generated),
            [r.sampling_params for r in reqs],
            [self._generators[r.request_id] for r in reqs],
            [
                [*r.all_token_ids, *e] if r.sampling_params.repetition_penalty != 1.0 else ()
                for r, e in zip(reqs, emitted, strict=True)
            ],
        )

    def _verify(
        self,
        verifying: list[_Verification],
        logits: torch.Tensor,  # [rows, vocab]: one row per tree node, from each first_row
        hidden_states: torch.Tensor,  # [rows, hidden]
    ) -> None:
        """Walk each tree from its root, choosing tokens exactly as a plain step would and
        descending while a child holds the chosen token; then move the accepted nodes' K/V to
        consecutive cache positions, where the scheduler's rollback expects them."""
        active = list(verifying)
        while active:
            rows = torch.tensor([v.first_row + v.node for v in active], dtype=torch.int64)
            token_ids, details = self._sample(
                logits.index_select(0, rows),
                [v.request for v in active],
                [v.token_ids for v in active],
            )
            still_active = []
            for v, token, detail in zip(active, token_ids, details, strict=True):
                v.token_ids.append(token)
                v.details.append(detail)
                child = v.tree.child(v.node, token)
                if child is not None:
                    v.node = child
                    still_active.append(v)
            active = still_active
        src: list[int] = []
        dst: list[int] = []
        for v in verifying:
            request_id = v.request.request_id
            start = v.request.num_computed_tokens
            for depth, node in enumerate(v.tree.path(v.node), 1):
                if node != depth:
                    src += self.kv.slot_mapping(request_id, start + node, start + node + 1)
                    dst += self.kv.slot_mapping(request_id, start + depth, start + depth + 1)
            self._hidden_states[request_id] = hidden_states[v.first_row + v.node]
            if self.policy is not None:
                self.policy.observe_tree(v.tree, v.token_ids)
        self.runner.copy_slots(src, dst)

    def _propose(self) -> None:
        """Draft trees for the next step, for greedy requests exactly one token behind."""
        hidden_states, self._hidden_states = self._hidden_states, {}
        if self.proposer is None or self.scheduler.num_running > self.spec_max_batch_size:
            return
        inputs = []
        max_model_len = self.scheduler.max_model_len
        for req in self.scheduler.running:
            hidden = hidden_states.get(req.request_id)
            if (
                hidden is None
                or not req.sampling_params.greedy
                or req.num_computed_tokens != req.num_tokens - 1
            ):
                continue
            remaining = min(
                req.sampling_params.max_new_tokens - req.num_output_tokens,
                max_model_len - req.num_tokens,
            )
            max_depth = min(self.proposer.num_heads, remaining - 1)
            if max_depth >= 1:
                inputs.append(ProposalInput(req.request_id, req.all_token_ids, hidden, max_depth))
        num_candidates = self.proposer.num_candidates
        if self.policy is not None:
            drafting = {p.request_id for p in inputs}
            num_plain_rows = min(
                sum(
                    req.num_tokens - req.num_computed_tokens
                    for req in self.scheduler.running
                    if req.request_id not in drafting
                ),
                self.scheduler.config.max_num_batched_tokens - len(inputs),
            )
            num_candidates = self.policy.choose(num_plain_rows, len(inputs))
            if self.policy.probing:
                inputs = inputs[:1]
        if not inputs or num_candidates == 0:
            return
        trees = self.proposer.propose(inputs)
        if num_candidates < self.proposer.num_candidates:
            trees = [t.first_candidates(num_candidates) for t in trees]
        self._trees = {p.request_id: t for p, t in zip(inputs, trees, strict=True)}
        self.scheduler.update_draft_token_ids(
            {request_id: tree.token_ids for request_id, tree in self._trees.items()}
        )

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

    def _adjust_eos(
        self, logits: torch.Tensor, reqs: list[Request], num_generated: list[int]
    ) -> torch.Tensor:
        """Before `min_new_tokens`, EOS cannot be chosen (TGIS's MinNewTokens processor); after
        it, a length penalty (start, decay) adds |eos| * (decay ** (generated - start) - 1) to
        each EOS score once more than `start` tokens were generated. Row i's request has
        generated `num_generated[i]` tokens."""
        logits = self._suppress_early_eos(logits, reqs, num_generated)
        cloned = False
        for i, r in enumerate(reqs):
            lp = r.sampling_params.length_penalty
            generated = num_generated[i]
            if lp is None or generated < r.sampling_params.min_new_tokens or generated <= lp[0]:
                continue
            if not cloned:
                logits, cloned = logits.clone(), True
            for eos in sorted(self.eos_token_ids):
                score = logits[i, eos]
                logits[i, eos] = score + score.abs() * (lp[1] ** (generated - lp[0]) - 1)
        return logits

    def _suppress_early_eos(
        self, logits: torch.Tensor, reqs: list[Request], num_generated: list[int]
    ) -> torch.Tensor:
        """Before `min_new_tokens`, EOS cannot be chosen (TGIS's MinNewTokens processor)."""
        rows = [
            i
            for i, r in enumerate(reqs)
            if num_generated[i] < r.sampling_params.min_new_tokens
            and not r.sampling_params.ignore_eos
        ]
        if not rows or not self.eos_token_ids:
            return logits
        logits = logits.clone()
        eos = torch.tensor(sorted(self.eos_token_ids), device=logits.device)
        logits[torch.tensor(rows, device=logits.device)[:, None], eos] = float("-inf")
        return logits
