"""Continuous batching over the paged KV cache, with vLLM v1's single scheduling rule.

NOTE: there is no prefill phase and no decode phase. Each request has `num_computed_tokens`
(tokens whose K/V are in the cache) and `num_tokens_with_spec` (prompt + output + drafts); each
step hands out tokens from a budget so that the first catches up with the second:

    | prompt ...................... | output ....... | drafts   |
    |<------ num_computed_tokens ------>|<-- num_new_tokens -->|
                                        (last output + drafts: a decode step with speculation)

A long prompt becomes several chunks, a decode is 1 token and speculative verification 1 + k.
Running requests are served before waiting ones, and each keeps at least one token per step,
so a long prompt never stalls running streams. One step is always
`schedule(now)` -> model -> `update_from_output(...)` [-> `update_draft_trees(...)`].
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.kv_cache import KVCacheManager
from engine.request import FinishReason, Request, RequestStatus
from engine.spec_decode.tree import DraftTree


class SchedulerError(Exception):
    """A failed `Scheduler.check_integrity`, or model output that breaks the step contract."""


@dataclass
class SchedulerOutput:
    """One step's work. The model computes, for each request in `scheduled_requests` (in order),
    the tokens at positions `[num_computed_tokens, num_computed_tokens + n)` with
    `n = num_scheduled_tokens[request_id]`: known tokens (`request.all_token_ids`) followed by
    the nodes of `scheduled_draft_trees[request_id]` (the request's draft tree, possibly cut to
    fewer nodes than proposed: `DraftTree.truncate`). K/V slots for them exist in
    `kv.block_table(request_id)`."""

    scheduled_requests: list[Request]
    num_scheduled_tokens: dict[str, int]
    scheduled_draft_trees: dict[str, DraftTree]
    total_num_scheduled_tokens: int
    preempted_req_ids: list[str]
    finished_requests: list[Request] = field(default_factory=list)
    """Finished by the scheduler since the last step (aborted, time limit, ignored); not run."""
    admitted_req_ids: list[str] = field(default_factory=list)
    """Moved from the waiting queue (new or preempted) into the running batch, in order."""


@dataclass(frozen=True)
class RequestOutput:
    """What one request gained in one step: tokens to stream and, if finished, why."""

    request_id: str
    new_token_ids: list[int]
    status: RequestStatus
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0  # drafts accepted; may exceed what was kept after a stop

    @property
    def finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason


class Scheduler:
    """Owns the waiting queue (FCFS; preempted requests go back to its front), the running batch
    and every request's KV blocks. Never fails a request for lack of blocks: a running request
    that cannot grow preempts the newest-arrived running request (possibly itself), which later
    recomputes prompt + output. Not thread-safe: call it from the engine loop only.

    The effective max model length is `min(config.max_model_len, whole KV pool in tokens)`, so a
    request admitted alone always fits; a prompt of that length or more is finished at
    `add_request` with FINISHED_IGNORED (FinishReason.ERROR), reported by the next `schedule()`.
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.max_model_len = min(config.max_model_len, self.kv.num_blocks * self.kv.block_size)
        self.requests: dict[str, Request] = {}  # waiting + running
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self._abort_ids: dict[str, None] = {}  # an ordered set
        self._finished: list[Request] = []  # finished outside schedule(), to report
        self.num_preemptions = 0  # since start: running requests whose blocks were taken back

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        """True while `schedule()` has requests to run or finished requests to report."""
        return bool(self.requests or self._finished)

    def add_request(self, request: Request) -> None:
        """Queue a new WAITING request; raises ValueError for a duplicate live id."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.status != RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id!r} is not new")
        if request.num_prompt_tokens >= self.max_model_len:
            request.status = RequestStatus.FINISHED_IGNORED
            self._finished.append(request)
            return
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> None:
        """Cancel a request (client gone): it is dropped from the batch and its blocks are freed
        at the next `schedule()`, which reports it; tokens a step in flight samples for it are
        discarded. Unknown or finished ids are ignored (cancellation races completion)."""
        if request_id in self.requests:
            self._abort_ids[request_id] = None

    def update_draft_trees(self, draft_trees: Mapping[str, DraftTree]) -> None:
        """Set the draft tree each request proposes for the next step. Ignored for requests that
        are gone or not exactly one token behind (mid-prefill, preempted)."""
        for request_id, tree in draft_trees.items():
            req = self.requests.get(request_id)
            if (
                req is not None
                and req.status == RequestStatus.RUNNING
                and req.num_computed_tokens == req.num_tokens - 1
            ):
                req.draft_tree = tree if tree.num_drafts else None

    def drop_draft_trees(self) -> None:
        """Forget the draft trees proposed for the next step (those requests decode plainly)."""
        for req in self.running:
            req.draft_tree = None

    def schedule(self, now: float) -> SchedulerOutput:
        """Drop aborted and expired (`deadline <= now`) requests, then give each running request
        and then each waiting one (FCFS, while `max_num_seqs` allows and its blocks fit)
        `min(num_tokens_with_spec - num_computed_tokens, budget)` tokens. Waiting requests are
        not admitted in a step that preempted; an admitted one starts after the longest prefix
        of its prompt in the KV manager's prefix cache (when enabled and its prompt logprobs are
        not wanted)."""
        finished, self._finished = self._finished, []
        for request_id in list(self._abort_ids):
            finished.append(self._finish(self.requests[request_id], RequestStatus.FINISHED_ABORTED))
        for req in [*self.running, *self.waiting]:
            if req.deadline is not None and now >= req.deadline:
                finished.append(self._finish(req, RequestStatus.FINISHED_TIME_LIMIT))

        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        trees: dict[str, DraftTree] = {}
        preempted: list[str] = []
        admitted: list[str] = []
        for req in list(self.running):
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            # Keep one token for each running request not yet visited.
            reserve = len(self.running) - len(num_scheduled) - 1
            num_new = self._num_new_tokens(req, budget - reserve)
            while not self.kv.allocate_slots(req.request_id, req.num_computed_tokens + num_new):
                victim = max(reversed(self.running), key=lambda r: r.arrival_time)
                budget += num_scheduled.pop(victim.request_id, 0)
                trees.pop(victim.request_id, None)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:  # allocated without preempting `req` itself
                num_scheduled[req.request_id] = num_new
                budget -= num_new
                num_spec = req.num_computed_tokens + num_new - req.num_tokens
                if num_spec > 0 and req.draft_tree is not None:
                    trees[req.request_id] = req.draft_tree.truncate(num_spec)
                req.draft_tree = None

        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            req = self.waiting[0]
            if not req.sampling_params.prompt_logprobs:  # those need every prompt position
                req.num_computed_tokens = self.kv.allocate_cached_prefix(
                    req.request_id, req.prompt_token_ids, req.cache_salt
                )
            num_new = self._num_new_tokens(req, budget)
            if not self.kv.allocate_slots(req.request_id, req.num_computed_tokens + num_new):
                if self.kv.has(req.request_id):
                    self.kv.free(req.request_id)
                req.num_computed_tokens = 0
                break  # FCFS: the head waits for blocks, nobody overtakes it
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            admitted.append(req.request_id)
            num_scheduled[req.request_id] = num_new
            budget -= num_new

        return SchedulerOutput(
            scheduled_requests=[r for r in self.running if r.request_id in num_scheduled],
            num_scheduled_tokens=num_scheduled,
            scheduled_draft_trees=trees,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            preempted_req_ids=preempted,
            finished_requests=finished,
            admitted_req_ids=admitted,
        )

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        sampled_token_ids: Mapping[str, Sequence[int]],
        now: float,
        failed_request_ids: Collection[str] = (),
    ) -> list[RequestOutput]:
        """Apply one step's model output and return, in schedule order, each request that got
        tokens or finished.

        `sampled_token_ids[request_id]` is required (and only allowed) for a request whose
        computation reached its last known token this step: the accepted drafts followed by one
        sampled (bonus) token, 1 to k+1 tokens for k scheduled drafts. The K/V of accepted drafts
        must sit at their sequence positions. Rejected drafts are rolled back
        (`num_computed_tokens -= num_rejected`, blocks truncated). Per appended token, in TGIS
        order: deadline -> FINISHED_TIME_LIMIT; from `min_new_tokens` on, an EOS (unless
        ignore_eos) or stop token id -> FINISHED_STOPPED; `max_new_tokens` or the max model
        length -> FINISHED_LENGTH. Tokens after a stop are dropped; finished requests are freed.
        A request in `failed_request_ids` (its token choice failed) finishes FINISHED_ERROR
        without tokens; the others are unaffected.
        """
        outputs: list[RequestOutput] = []
        for req in scheduler_output.scheduled_requests:
            request_id = req.request_id
            if req.status != RequestStatus.RUNNING or request_id in self._abort_ids:
                continue  # finished or aborted while the step was in flight
            if request_id in failed_request_ids:
                self._finish(req, RequestStatus.FINISHED_ERROR)
                outputs.append(RequestOutput(request_id, [], req.status))
                continue
            computed_prompt = req.num_computed_tokens < req.num_prompt_tokens
            req.num_computed_tokens += scheduler_output.num_scheduled_tokens[request_id]
            if computed_prompt:  # this step computed prompt tokens: share their full blocks
                self.kv.cache_computed_blocks(
                    request_id, req.prompt_token_ids[: req.num_computed_tokens], req.cache_salt
                )
            sampled = sampled_token_ids.get(request_id, ())
            if req.num_computed_tokens < req.num_tokens:  # a prefill chunk: nothing to sample
                if sampled:
                    raise SchedulerError(f"{request_id!r}: tokens sampled mid-prefill")
                continue
            tree = scheduler_output.scheduled_draft_trees.get(request_id)
            num_drafts = 0 if tree is None else tree.num_drafts
            if not 1 <= len(sampled) <= num_drafts + 1:
                raise SchedulerError(
                    f"{request_id!r}: {len(sampled)} sampled tokens for {num_drafts} drafts"
                )
            # The K/V slots of rejected drafts hold garbage: recompute from there next step.
            req.num_computed_tokens -= num_drafts + 1 - len(sampled)
            self.kv.truncate(request_id, req.num_computed_tokens)
            new_token_ids = self._append_and_check_stop(req, sampled, now)
            outputs.append(
                RequestOutput(request_id, new_token_ids, req.status, num_drafts, len(sampled) - 1)
            )
        return outputs

    def check_integrity(self) -> None:
        """Raise KVCacheError/SchedulerError unless the KV manager is consistent, waiting and
        running partition the live requests, every running request holds blocks covering its
        `num_computed_tokens < num_tokens`, and no block is held by anyone else (no leak: this
        assumes the scheduler is the KV manager's only user; running requests share blocks only
        through the prefix cache)."""
        self.kv.check_integrity()
        ids = [r.request_id for r in self.running] + [r.request_id for r in self.waiting]
        if len(set(ids)) != len(ids) or set(ids) != self.requests.keys():
            raise SchedulerError("waiting + running do not partition the live requests")
        if len(self.running) > self.config.max_num_seqs:
            raise SchedulerError(f"{len(self.running)} running > max_num_seqs")
        blocks: set[int] = set()
        for r in self.running:
            rid = r.request_id
            if r.status != RequestStatus.RUNNING or not self.kv.has(rid):
                raise SchedulerError(
                    f"running {rid!r}: status {r.status!r}, blocks {self.kv.has(rid)}"
                )
            if not r.num_computed_tokens <= self.kv.num_tokens(rid):
                raise SchedulerError(f"running {rid!r}: blocks do not cover computed tokens")
            if not r.num_computed_tokens < r.num_tokens:
                raise SchedulerError(f"running {rid!r}: {r.num_computed_tokens} computed tokens")
            blocks.update(self.kv.block_table(rid))
        for r in self.waiting:
            if r.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                raise SchedulerError(f"waiting {r.request_id!r} has status {r.status!r}")
            if self.kv.has(r.request_id) or r.num_computed_tokens:
                raise SchedulerError(f"waiting {r.request_id!r} holds blocks or computed tokens")
        if len(blocks) != self.kv.num_used_blocks:
            raise SchedulerError(f"{self.kv.num_used_blocks} used blocks, {len(blocks)} running")

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        # Drafts are tree nodes in consecutive slots (their depth, which bounds the tokens they
        # can add, is the proposer's business): only their slots must fit max_model_len.
        num_new = min(req.num_tokens_with_spec, self.max_model_len) - req.num_computed_tokens
        assert num_new >= 1 and budget >= 1, (req.request_id, num_new, budget)
        return min(num_new, budget)

    def _append_and_check_stop(self, req: Request, sampled: Sequence[int], now: float) -> list[int]:
        params = req.sampling_params
        for i, token in enumerate(sampled):
            req.append_output_token_ids(token)
            status: RequestStatus | None = None
            if req.deadline is not None and now >= req.deadline:
                status = RequestStatus.FINISHED_TIME_LIMIT
            elif req.num_output_tokens >= params.min_new_tokens and (
                (token in req.eos_token_ids and not params.ignore_eos)
                or token in params.stop_token_ids
            ):
                status = RequestStatus.FINISHED_STOPPED
            elif (
                req.num_output_tokens >= params.max_new_tokens
                or req.num_tokens >= self.max_model_len
            ):
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                self._finish(req, status)
                return list(sampled[: i + 1])
        return list(sampled)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.draft_tree = None
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _finish(self, req: Request, status: RequestStatus) -> Request:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        if self.kv.has(req.request_id):
            self.kv.free(req.request_id)
        del self.requests[req.request_id]
        self._abort_ids.pop(req.request_id, None)
        req.status = status
        req.draft_tree = None
        return req
