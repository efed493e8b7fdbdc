"""The step loop: schedule -> one forward pass -> sample or verify -> update the requests.

`LLMEngine` is synchronous and single-threaded: the offline API drives it directly and the server
runs it on its own thread, handing it new and cancelled requests between steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from engine.batch import StepBatch, build_batch, count_prefill_tokens
from engine.config import SchedulerConfig
from engine.device import use_device
from engine.hooks import TokenObserver
from engine.host_copy import read_values
from engine.kv_cache import KVCacheManager
from engine.model_runner import ModelRunner
from engine.outputs import EngineOutput, EngineStepOutput, RequestEvent, StepStats
from engine.outputs import RequestEventType as Event
from engine.request import PromptPrefix, Request
from engine.sampling.params import SamplingParams, draw_seed
from engine.sampling.prompt_logprobs import PromptLogprobs
from engine.sampling.sampler import Choices, Sampler, TokenLogprobs
from engine.scheduler import RequestOutput, Scheduler, SchedulerOutput
from engine.spec_decode.drafter import Drafter, DraftingView, PendingDrafts
from engine.spec_decode.policy import Method
from engine.spec_decode.tree import DraftTree
from engine.spec_decode.verifier import accepted_slot_moves
from engine.spec_decode.walk import choose_tokens
from engine.step_io import ModelOutput

logger = logging.getLogger(__name__)


@dataclass
class _Results:
    token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    draft_depths: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    drafts: PendingDrafts | None = None  # drafted on the device for the next step
    draft_values: list[float] | None = None  # `drafts.values` read on the host
    last_choices: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Where each request's walk ended: the choice's index and token."""


class LLMEngine:
    """Owns the scheduler, the KV manager and the model runner; `step()` advances every
    scheduled request by one forward pass and returns what each request gained, the step's
    figures and the requests' events (`EngineStepOutput`).

    With a `drafter`, requests draft a token tree after each step (see `Drafter`) and
    the next step verifies it in the same forward pass as everything else: the request gains the
    longest draft path equal to its own choices plus one token, exactly the tokens it would have
    produced one by one (every per-token rule: min_new_tokens, penalties, logprobs, stops, is
    applied along the path). `observers` see every row a token is chosen from.

    A request whose own logits are non-finite or whose token choice fails finishes with
    FinishReason.ERROR and `EngineOutput.error`; the rest of the batch is unaffected. An
    exception from `step()` itself (the shared forward pass) leaves the engine usable once the
    caller aborts the requests of that step.
    """

    def __init__(
        self,
        runner: ModelRunner,
        scheduler_config: SchedulerConfig,
        eos_token_ids: frozenset[int],
        drafter: Drafter | None = None,
        enable_prefix_caching: bool = True,
    ) -> None:
        """With `enable_prefix_caching`, requests share the KV blocks of identical prompt
        prefixes."""
        self.runner = runner
        self.kv = KVCacheManager(runner.num_blocks, runner.block_size, enable_prefix_caching)
        self.scheduler = Scheduler(scheduler_config, self.kv)
        self.eos_token_ids = eos_token_ids
        self.drafter = drafter
        self.observers: list[TokenObserver] = []
        self.sampler = Sampler()
        self.prompt_logprobs = PromptLogprobs()
        self._events: list[RequestEvent] = []  # since the last step

    @property
    def max_model_len(self) -> int:
        """The longest a request may grow (prompt + output): the configured limit, or less
        when the whole KV pool holds fewer tokens."""
        return self.scheduler.max_model_len

    @property
    def num_kv_blocks(self) -> int:
        """The KV pool's blocks (`StepStats.num_used_blocks` of them are held)."""
        return self.kv.num_blocks

    def bind_thread(self) -> None:
        """Make the engine's device the calling thread's current CUDA device (`engine.device`):
        call it first on every thread that runs `step()`."""
        use_device(self.runner.device)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        time_limit_s: float | None = None,
        prompt_prefix: PromptPrefix | None = None,
    ) -> None:
        """Queue a request. A sampling request without a seed gets one (`draw_seed`). With
        `prompt_prefix` (prompt tuning), its embeddings come before `prompt_token_ids` and count
        toward the request's length; they must have the model's hidden size (else ValueError;
        other dtypes and devices are converted), and a request with a prefix cannot ask for
        `prompt_logprobs` (ValueError). A `logit_bias` id outside the model's vocabulary is a
        ValueError too."""
        params.check_token_ids(self.runner.config.vocab_size)
        if prompt_prefix is not None:
            prompt_prefix = self._model_prefix(prompt_prefix, params)
        if not params.greedy and params.seed is None:
            params = replace(params, seed=draw_seed())
        now = time.monotonic()
        self.scheduler.add_request(
            Request(
                request_id,
                prompt_token_ids,
                params,
                arrival_time=now,
                deadline=None if time_limit_s is None else now + time_limit_s,
                eos_token_ids=self.eos_token_ids,
                prompt_prefix=prompt_prefix,
            )
        )
        self._events.append(RequestEvent(request_id, Event.QUEUED, now))

    def _model_prefix(self, prefix: PromptPrefix, params: SamplingParams) -> PromptPrefix:
        """`prefix` in the model's dtype on its device (keeping its key); ValueError for another
        hidden size or with prompt logprobs."""
        embeds, runner = prefix.embeds, self.runner
        hidden = runner.config.hidden_size
        if embeds.shape[1] != hidden:
            raise ValueError(
                f"prompt prefix hidden size {embeds.shape[1]} does not match the model's {hidden}"
            )
        if params.prompt_logprobs:
            raise ValueError("prompt logprobs are not supported with a prompt prefix")
        if embeds.dtype == runner.dtype and embeds.device.type == runner.device.type:
            return prefix
        return PromptPrefix(embeds.to(runner.device, runner.dtype), prefix.key)

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id)

    def set_drafter(self, drafter: Drafter | None) -> None:
        """Attach, swap or detach (None) the drafter between steps. Drafts proposed for the
        next step are dropped (unless `drafter` is the one attached): those requests decode it
        plainly."""
        if drafter is self.drafter:
            return
        self.scheduler.drop_draft_trees()
        self.drafter = drafter

    def close(self) -> None:
        """Release the runner's processes (tensor-parallel ranks); the engine is unusable
        afterwards. Idempotent."""
        self.runner.close()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineStepOutput:
        """Run one step. Its outputs are the requests that gained tokens or finished, including
        those the scheduler finished without running (aborted, time limit, too long)."""
        start = time.perf_counter()
        num_hits = self.kv.num_prefix_hit_tokens
        now = time.monotonic()
        sched = self.scheduler.schedule(now)
        events, self._events = self._events, []
        events += [RequestEvent(r.request_id, Event.FINISHED, now) for r in sched.finished_requests]
        events += [RequestEvent(i, Event.PREEMPTED, now) for i in sched.preempted_req_ids]
        events += [RequestEvent(i, Event.SCHEDULED, now) for i in sched.admitted_req_ids]
        outputs = [EngineOutput(r.request_id, [], r.status) for r in sched.finished_requests]
        num_prefill_tokens = count_prefill_tokens(sched)
        hidden_states: dict[str, torch.Tensor] = {}
        results = _Results()
        if sched.scheduled_requests:
            results = self._execute(sched, hidden_states)
            now = time.monotonic()
            updates = self.scheduler.update_from_output(
                sched, results.token_ids, now, results.errors.keys()
            )
            scheduled = {r.request_id: r for r in sched.scheduled_requests}
            for update in updates:
                request_id, num_new = update.request_id, len(update.new_token_ids)
                outputs.append(self._engine_output(update, results))
                if num_new and scheduled[request_id].num_output_tokens == num_new:
                    events.append(RequestEvent(request_id, Event.FIRST_TOKEN, now))
                if update.finished:
                    events.append(RequestEvent(request_id, Event.FINISHED, now))
        for out in outputs:
            if out.finished:
                self.prompt_logprobs.pop(out.request_id)
        trees: dict[str, DraftTree] = {}
        if self.drafter is not None:
            if sched.scheduled_requests:
                num_trees = len(sched.scheduled_draft_trees)
                seconds = time.perf_counter() - start
                self.drafter.observe_step(sched.total_num_scheduled_tokens, seconds, num_trees)
            trees = self._next_trees(results, hidden_states)
            self.scheduler.update_draft_trees(trees)
        stats = self._stats(sched, outputs, trees, num_prefill_tokens, num_hits)
        return EngineStepOutput(outputs, stats, events)

    def _stats(
        self,
        sched: SchedulerOutput,
        outputs: list[EngineOutput],
        trees: dict[str, DraftTree],
        num_prefill_tokens: int,
        num_prefix_hit_tokens: int,  # the KV manager's count before the step
    ) -> StepStats:
        running = self.scheduler.running
        verified = [out for out in outputs if out.num_draft_tokens]
        return StepStats(
            num_scheduled_reqs=len(sched.scheduled_requests),
            num_scheduled_tokens=sched.total_num_scheduled_tokens,
            num_prefill_tokens=num_prefill_tokens,
            num_decode_tokens=sched.total_num_scheduled_tokens - num_prefill_tokens,
            num_admitted_reqs=len(sched.admitted_req_ids),
            num_preempted_reqs=len(sched.preempted_req_ids),
            num_prefix_hit_tokens=self.kv.num_prefix_hit_tokens - num_prefix_hit_tokens,
            num_generated_tokens=sum(len(out.new_token_ids) for out in outputs),
            num_spec_reqs=len(verified),
            num_draft_tokens=sum(out.num_draft_tokens for out in verified),
            num_accepted_tokens=sum(out.num_accepted_tokens for out in verified),
            num_proposed_reqs=len(trees),
            num_proposed_tokens=sum(tree.num_drafts for tree in trees.values()),
            num_running_reqs=len(running),
            num_waiting_reqs=self.scheduler.num_waiting,
            num_running_tokens=sum(r.num_tokens for r in running),
            num_remaining_tokens=sum(
                max(0, r.sampling_params.max_new_tokens - r.num_output_tokens) for r in running
            ),
            num_used_blocks=self.kv.num_used_blocks,
            num_blocks=self.kv.num_blocks,
        )

    def _drafting_view(self) -> DraftingView:
        s = self.scheduler
        return DraftingView(s.running, s.max_model_len, s.config.max_num_batched_tokens)

    def _next_trees(
        self, results: _Results, hidden_states: dict[str, torch.Tensor]
    ) -> dict[str, DraftTree]:
        """The drafter's trees for the next step: those drafted before the step's read, or
        drafted now from `hidden_states`; none this step when drafting fails (the requests go
        on without speculation)."""
        assert self.drafter is not None
        view = self._drafting_view()
        if self.drafter.drafts_on_device:
            values = results.draft_values or []
            return self.drafter.finish(view, results.drafts, values, results.last_choices)
        try:
            return self.drafter.propose(view, hidden_states)
        except (RuntimeError, ValueError) as e:
            logger.warning("drafting failed, this step decodes without drafts: %s", e)
            return {}

    def _engine_output(self, out: RequestOutput, results: _Results) -> EngineOutput:
        lps = results.logprobs.get(out.request_id)
        return EngineOutput(
            out.request_id,
            out.new_token_ids,
            out.status,
            out.num_draft_tokens,
            out.num_accepted_tokens,
            None if lps is None else lps[: len(out.new_token_ids)],
            self.prompt_logprobs.pop(out.request_id) if out.new_token_ids else None,
            results.draft_depths.get(out.request_id, 0),
            results.errors.get(out.request_id),
        )

    def _execute(
        self,
        sched: SchedulerOutput,
        hidden_states: dict[str, torch.Tensor],  # filled: request id -> [hidden]
    ) -> _Results:
        """Run the model, then choose each completing request's tokens: one from its last row,
        or a walk down its draft tree. Fills `hidden_states` with the state each request's last
        chosen token came from."""
        whole = bool(self.observers)
        batch = build_batch(sched, self.kv, self.prompt_logprobs, rows_read_whole=whole)
        out = self.runner.execute(batch.inputs)
        results = _Results()
        for req, row, positions in batch.prompt_rows:
            rows = out.logits[row : row + len(positions)]
            try:
                self.prompt_logprobs.record(req, rows, positions)
            except (RuntimeError, ValueError) as e:
                results.errors[req.request_id] = str(e)
        drafting = self.drafter is not None and self.drafter.drafts_on_device
        pending = choose_tokens(self.sampler, out.logits, self.runner.rows_index, batch, drafting)
        if pending is not None and pending.token_ids is not None and self.drafter is not None:
            # the rows' tokens stay on the device when the drafter drafts there
            results.drafts = self.drafter.launch(
                self._drafting_view(), sched, batch, pending.token_ids, out.hidden_states
            )
        drafted = None if results.drafts is None else results.drafts.values
        values, results.draft_values = read_values(
            [None if pending is None else pending.values, drafted]
        )  # the step's one read of the device
        choices = Choices([], [], [])
        if pending is not None:
            choices = pending.finish([] if values is None else values)
        for req, i in batch.sampling:
            error, detail = choices.errors[i], choices.details[i]
            if error is not None:
                results.errors.setdefault(req.request_id, error)
                continue
            results.last_choices[req.request_id] = (i, choices.token_ids[i])
            results.token_ids[req.request_id] = [choices.token_ids[i]]
            if detail is not None:
                results.logprobs[req.request_id] = [detail]
            hidden_states[req.request_id] = out.hidden_states[batch.choice_rows[i]]
        for v in batch.verifying:
            v.walk(choices)
            request_id = v.request.request_id
            if v.error is not None:
                results.errors[request_id] = v.error
                continue
            results.token_ids[request_id] = v.token_ids
            if v.request.sampling_params.logprobs:
                results.logprobs[request_id] = [d for d in v.details if d is not None]
            results.draft_depths[request_id] = v.tree.depth
            results.last_choices[request_id] = (v.first_choice + v.node, v.token_ids[-1])
            hidden_states[request_id] = out.hidden_states[v.last_row]
            if self.drafter is not None:
                self.drafter.observe_tree(v.tree, v.token_ids, Method.of(v.request.sampling_params))
        self._observe(out, batch)
        self.runner.copy_slots(*accepted_slot_moves(batch.verifying, self.kv))
        return results

    def _observe(self, out: ModelOutput, batch: StepBatch) -> None:
        """Show the observers the rows the step's tokens were chosen from: the sampled rows,
        then each tree's walked nodes."""
        if not self.observers:
            return
        sampled = [(req.request_id, batch.choice_rows[i]) for req, i in batch.sampling]
        walked = [(v.request.request_id, row) for v in batch.verifying for row in v.walked_rows()]
        for pairs, from_tree in ((sampled, False), (walked, True)):
            if pairs:
                index = self.runner.rows_index([row for _, row in pairs])
                request_ids = [request_id for request_id, _ in pairs]
                logits, hidden = out.logits[index], out.hidden_states[index]
                for observer in self.observers:
                    observer.on_logits(request_ids, logits, hidden, from_tree)
