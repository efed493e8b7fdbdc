"""The step loop: schedule -> one forward pass -> sample or verify -> update the requests.

`LLMEngine` is synchronous and single-threaded: the offline API drives it directly and the server
runs it on its own thread, handing it new and cancelled requests between steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.config import SchedulerConfig
from engine.hooks import TokenObserver
from engine.kv_cache import KVCacheManager
from engine.model_runner import ModelOutput, ModelRunner, SequenceInput
from engine.request import PromptPrefix, Request
from engine.sampling.params import SamplingParams
from engine.sampling.prompt_logprobs import PromptLogprobs
from engine.sampling.sampler import Choices, Sampler, TokenLogprobs
from engine.scheduler import RequestOutput, Scheduler, SchedulerOutput
from engine.spec_decode.drafter import Drafter
from engine.spec_decode.policy import Method
from engine.spec_decode.tree import DraftTree
from engine.spec_decode.verifier import Verification, accepted_slot_moves

logger = logging.getLogger(__name__)


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
    error: str | None = None
    """Why the request finished with FinishReason.ERROR, when its own logits or token choice
    failed this step."""


@dataclass
class _Batch:
    """One step's model inputs and the logits rows tokens are chosen from: one per request that
    reaches its last known token, one per node of each draft tree (in row order)."""

    inputs: list[SequenceInput] = field(default_factory=list)
    sampling: list[tuple[Request, int]] = field(default_factory=list)
    """(request, index of its choice) for requests that reach their last known token."""
    verifying: list[Verification] = field(default_factory=list)
    choice_rows: list[int] = field(default_factory=list)  # [C] logits rows to choose from
    choice_requests: list[Request] = field(default_factory=list)  # [C]
    choice_emitted: list[list[int]] = field(default_factory=list)
    """[C]: the tokens the request would have chosen this step before the row (a node's path)."""
    prompt_rows: list[tuple[Request, int, list[int]]] = field(default_factory=list)
    """(request, first row, the prompt positions its rows score) for prompt logprobs."""
    num_rows: int = 0

    def add_choice(self, row: int, request: Request, emitted: list[int]) -> int:
        """Choose a token from logits row `row`; returns the choice's index."""
        self.choice_rows.append(row)
        self.choice_requests.append(request)
        self.choice_emitted.append(emitted)
        return len(self.choice_rows) - 1


@dataclass
class _Results:
    token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    draft_depths: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


class LLMEngine:
    """Owns the scheduler, the KV manager and the model runner; `step()` advances every
    scheduled request by one forward pass and returns what each request gained.

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

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        time_limit_s: float | None = None,
        prompt_prefix: PromptPrefix | None = None,
    ) -> None:
        """Queue a request. With `prompt_prefix` (prompt tuning), its embeddings come before
        `prompt_token_ids` and count toward the request's length; they must have the model's
        hidden size (else ValueError; other dtypes and devices are converted), and a request
        with a prefix cannot ask for `prompt_logprobs` (ValueError)."""
        if prompt_prefix is not None:
            prompt_prefix = self._model_prefix(prompt_prefix, params)
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
        self.sampler.add_request(request_id, params)

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
        if self.drafter is not None:
            self.drafter.take_trees()
        self.scheduler.update_draft_token_ids({r.request_id: () for r in self.scheduler.running})
        self.drafter = drafter

    def close(self) -> None:
        """Release the runner's processes (tensor-parallel ranks); the engine is unusable
        afterwards. Idempotent."""
        self.runner.close()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineOutput]:
        """Run one step. Returns the requests that gained tokens or finished, including those the
        scheduler finished without running (aborted, time limit, too long)."""
        start = time.perf_counter()
        sched = self.scheduler.schedule(time.monotonic())
        outputs = [EngineOutput(r.request_id, [], r.status) for r in sched.finished_requests]
        hidden_states: dict[str, torch.Tensor] = {}
        if sched.scheduled_requests:
            results = self._execute(sched, hidden_states)
            now = time.monotonic()
            updates = self.scheduler.update_from_output(
                sched, results.token_ids, now, results.errors.keys()
            )
            for out in updates:
                outputs.append(self._engine_output(out, results))
        for out in outputs:
            if out.finished:
                self.sampler.remove_request(out.request_id)
                self.prompt_logprobs.pop(out.request_id)
        if self.drafter is not None:
            if sched.scheduled_requests:
                num_trees = len(sched.scheduled_spec_token_ids)
                seconds = time.perf_counter() - start
                self.drafter.observe_step(sched.total_num_scheduled_tokens, seconds, num_trees)
            self.scheduler.update_draft_token_ids(self._propose(hidden_states))
        return outputs

    def _propose(self, hidden_states: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
        """The drafter's proposals; none this step when drafting fails (the requests go on
        without speculation)."""
        assert self.drafter is not None
        try:
            return self.drafter.propose(self.scheduler, hidden_states)
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
        batch = self._build_batch(sched, self.drafter.take_trees() if self.drafter else {})
        out = self.runner.execute(batch.inputs)
        results = _Results()
        for req, row, positions in batch.prompt_rows:
            rows = out.logits[row : row + len(positions)]
            try:
                self.prompt_logprobs.record(req, rows, positions)
            except (RuntimeError, ValueError) as e:
                results.errors[req.request_id] = str(e)
        choices = self._choose(out, batch)
        for req, i in batch.sampling:
            error, detail = choices.errors[i], choices.details[i]
            if error is not None:
                results.errors.setdefault(req.request_id, error)
                continue
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
            hidden_states[request_id] = out.hidden_states[v.last_row]
            if self.drafter is not None:
                self.drafter.observe_tree(v.tree, v.token_ids, Method.of(v.request.sampling_params))
        self._observe(out, batch)
        self.runner.copy_slots(*accepted_slot_moves(batch.verifying, self.kv))
        return results

    def _build_batch(self, sched: SchedulerOutput, trees: dict[str, DraftTree]) -> _Batch:
        """One `SequenceInput` per scheduled request: its root token and drafts (a tree to
        verify), or a chunk of known tokens whose last row is sampled when it reaches the
        request's last known token, plus the rows prompt logprobs need."""
        batch = _Batch()
        for req in sched.scheduled_requests:
            n = sched.num_scheduled_tokens[req.request_id]
            start = req.num_computed_tokens
            block_table = self.kv.block_table(req.request_id)
            drafts = sched.scheduled_spec_token_ids.get(req.request_id)
            if drafts:
                tree = trees[req.request_id].truncate(len(drafts))
                v = Verification(req, tree, batch.num_rows, len(batch.choice_rows))
                for node, path in enumerate(tree.path_token_ids()):
                    batch.add_choice(batch.num_rows + node, req, path)
                batch.verifying.append(v)
                batch.num_rows += n
                batch.inputs.append(
                    SequenceInput(
                        token_ids=[req.all_token_ids[start], *drafts],
                        num_computed_tokens=start,
                        block_table=block_table,
                        positions=[start + d for d in tree.depths],
                        tree_mask=tree.attention_mask(),
                        logits_indices=list(range(n)),
                    )
                )
                continue
            indices = self.prompt_logprobs.logits_indices(req, start, n)
            if indices:
                positions = [start + j + 1 for j in indices]
                batch.prompt_rows.append((req, batch.num_rows, positions))
            if start + n >= req.num_tokens:
                indices.append(n - 1)
                row = batch.num_rows + len(indices) - 1
                batch.sampling.append((req, batch.add_choice(row, req, [])))
            batch.num_rows += len(indices)
            prefix_embeds = None
            if req.prompt_prefix is not None and start < req.num_prefix_tokens:
                prefix_embeds = req.prompt_prefix.embeds[start : start + n]
            batch.inputs.append(
                SequenceInput(
                    token_ids=list(req.all_token_ids[start : start + n]),
                    num_computed_tokens=start,
                    block_table=block_table,
                    logits_indices=indices,
                    prefix_embeds=prefix_embeds,
                )
            )
        return batch

    def _choose(self, out: ModelOutput, batch: _Batch) -> Choices:
        """One token (or an error) for each of the batch's choice rows, in one sampler call: one
        device-to-host copy for the whole step."""
        if not batch.choice_rows:
            return Choices([], [], [])
        logits = out.logits[self.runner.rows_index(batch.choice_rows)]
        return self.sampler.sample(logits, batch.choice_requests, batch.choice_emitted)

    def _observe(self, out: ModelOutput, batch: _Batch) -> None:
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
