"""Which requests draft after a step, how many candidates they verify, and their trees.

After each step the engine hands the `Drafter` the final-norm hidden state each request's last
token was chosen from. A request may draft, greedy or sampled (sampled tokens are keyed draws,
see `sampling.keyed_draw`), when it is exactly one token behind (its last token has no K/V yet:
it becomes the tree's root) and has room for at least one draft, while at
most `max_batch_size` requests run. The policy (when given) chooses how many candidates pay this
step, possibly none, and may ask for a probe: one request drafts, to measure.

Off a CPU, where reading the device waits for it, drafting happens before the step's one read
(`launch`): the walks' ends are found on the device, the speculator drafts from there, and the
read brings the heads' levels back with the step's choices; after the update, `finish` makes
the trees of the requests that still draft. On a CPU, `propose` drafts after the update from
the host's view of the step (the same rule).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from engine.request import Request
from engine.spec_decode.candidates import levels_from_values, levels_values
from engine.spec_decode.policy import Method, SpeculationPolicy
from engine.spec_decode.proposer import MLPProposer, ProposalInput, Proposer
from engine.spec_decode.tree import DraftTree
from engine.spec_decode.verifier import Verification, last_choices_on_device

if TYPE_CHECKING:
    from engine.batch import StepBatch
    from engine.scheduler import SchedulerOutput

_T = TypeVar("_T")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftingView:
    """What drafting reads of the scheduler after a step: the running requests (in admission
    order), the longest a request may grow (prompt + output) and the token budget of a step."""

    running: Sequence[Request]
    max_model_len: int
    max_num_batched_tokens: int


class Drafter:
    """Proposes, after each step, the draft trees of the next: the proposer drafts them, the
    policy (when given) decides how many candidates pay. Holds no trees: each one travels on its
    request (`Request.draft_tree`) into the scheduler's output."""

    def __init__(
        self, proposer: Proposer, policy: SpeculationPolicy | None, max_batch_size: int
    ) -> None:
        """Without a `policy` every drafting request verifies the proposer's whole tree."""
        self.proposer = proposer
        self.policy = policy
        self.max_batch_size = max_batch_size
        self._propose_seconds = 0.0  # drafting for the coming step, part of its cost
        self._launch_seconds = 0.0  # `launch` in the step being run: the next step's cost

    def observe_step(self, num_rows: int, seconds: float, num_trees: int) -> None:
        """A step of `num_rows` rows verifying `num_trees` trees took `seconds` (its drafting,
        timed by `propose` or `launch` and `finish`, is added here; `seconds` may include the
        next step's `launch`, which is taken out)."""
        if self.policy is not None:
            drafting = self._propose_seconds - self._launch_seconds
            self.policy.observe_step(num_rows, seconds + drafting, num_trees)

    def observe_tree(self, tree: DraftTree, token_ids: list[int], method: Method) -> None:
        """A verified tree of a request of `method` and the tokens the request gained from it."""
        if self.policy is not None:
            self.policy.observe_tree(tree, token_ids, method)

    def propose(
        self,
        view: DraftingView,
        hidden_states: dict[str, torch.Tensor],  # request id -> [hidden]
    ) -> dict[str, DraftTree]:
        """The draft tree of each request that drafts for the next step (for
        `Scheduler.update_draft_trees`)."""
        start = time.perf_counter()
        trees = self._draft(view, hidden_states)
        self._propose_seconds = time.perf_counter() - start
        return trees

    @property
    def drafts_on_device(self) -> bool:
        """Whether drafting happens before the step's read (`launch`, then `finish`), not
        after it (`propose`)."""
        return isinstance(self.proposer, MLPProposer) and self.proposer.drafts_on_device

    def launch(
        self,
        view: DraftingView,  # before the step's update
        sched: SchedulerOutput,
        batch: StepBatch,  # the step's choices
        token_ids: torch.Tensor,  # [C] int64 on the device: the token chosen at each choice
        hidden_states: torch.Tensor,  # [rows, hidden]: the step's final-norm states
    ) -> PendingDrafts | None:
        """Before a step's read, when `drafts_on_device`: the trees of the next step drafted on
        the device (None: no request drafts, or drafting failed and was logged), from where
        each drafting request's walk ends (`last_choices_on_device`); the step reads
        `PendingDrafts.values` with its choices.

        Who drafts follows `propose`'s rule for the requests that choose tokens this step,
        each taken to gain one token and none to finish: `finish` drops those that did finish
        and cuts the trees of those that gained more."""
        start = time.perf_counter()
        try:
            return self._launch(view, sched, batch, token_ids, hidden_states)
        finally:
            self._launch_seconds = time.perf_counter() - start

    def _launch(
        self,
        view: DraftingView,
        sched: SchedulerOutput,
        batch: StepBatch,
        token_ids: torch.Tensor,
        hidden_states: torch.Tensor,
    ) -> PendingDrafts | None:
        assert isinstance(self.proposer, MLPProposer)
        if len(view.running) > self.max_batch_size:
            return None
        walks: dict[str, int | Verification] = {req.request_id: i for req, i in batch.sampling}
        walks.update((v.request.request_id, v) for v in batch.verifying)
        num_plain_rows = 0  # the rows the others will run next step
        ready: list[tuple[Request, int | Verification, int]] = []  # (request, walk, max depth)
        for req in view.running:
            walk = walks.get(req.request_id)
            if walk is None:
                scheduled = sched.num_scheduled_tokens.get(req.request_id, 0)
                num_plain_rows += req.num_tokens - req.num_computed_tokens - scheduled
                continue
            room = min(
                req.sampling_params.max_new_tokens - req.num_output_tokens,
                view.max_model_len - req.num_tokens,
            )
            if room - 1 > 1:  # after the one token it gains at least
                ready.append((req, walk, min(self.proposer.num_heads, room - 2)))
            else:
                num_plain_rows += 1
        chosen = self._choose(ready, num_plain_rows, view)
        if not chosen:
            return None
        walked = [w for _, w, _, _ in chosen]
        try:
            last, rows = last_choices_on_device(walked, batch.choice_rows, token_ids)
            levels = self.proposer.draft_levels(hidden_states[rows], token_ids[last])
        except (RuntimeError, ValueError) as e:
            logger.warning("drafting failed, the next step decodes without drafts: %s", e)
            return None
        values = torch.cat([last.double(), token_ids[last].double(), levels_values(levels)])
        return PendingDrafts([(req, k) for req, _, _, k in chosen], levels, values)

    def finish(
        self,
        view: DraftingView,  # after the step's update
        drafts: PendingDrafts | None,  # `launch`'s in this step (None: none)
        values: Sequence[float],  # `drafts.values` read on the host
        last_choices: dict[str, tuple[int, int]],  # request id -> its walk's last choice, token
    ) -> dict[str, DraftTree]:
        """The draft trees of `drafts`' requests that still draft after the step (`propose`'s
        rule, each tree cut to the room its request has left): running, with tokens gained
        from the choice their drafts were made from (the one the host's walk ended at, with the
        same token). No trees when drafting fails (logged)."""
        start = time.perf_counter()
        try:
            return self._finish(view, drafts, values, last_choices)
        finally:
            self._propose_seconds = self._launch_seconds + time.perf_counter() - start
            self._launch_seconds = 0.0

    def _finish(
        self,
        view: DraftingView,
        drafts: PendingDrafts | None,
        values: Sequence[float],
        last_choices: dict[str, tuple[int, int]],
    ) -> dict[str, DraftTree]:
        assert isinstance(self.proposer, MLPProposer)
        if drafts is None:
            return {}
        num = len(drafts.chosen)
        walked = [
            (int(i), int(t)) for i, t in zip(values[:num], values[num : 2 * num], strict=True)
        ]
        running = {r.request_id for r in view.running}
        kept: list[tuple[str, int, int, int]] = []  # request id, row, max depth, candidates
        if len(running) <= self.max_batch_size:
            for row, ((req, k), last) in enumerate(zip(drafts.chosen, walked, strict=True)):
                request_id = req.request_id
                if request_id not in running or last_choices.get(request_id) != last:
                    continue
                remaining = min(
                    req.sampling_params.max_new_tokens - req.num_output_tokens,
                    view.max_model_len - req.num_tokens,
                )
                if req.num_computed_tokens == req.num_tokens - 1 and remaining > 1:
                    kept.append((request_id, row, min(self.proposer.num_heads, remaining - 1), k))
        trees: dict[str, DraftTree] = {}
        if kept:
            levels = levels_from_values(drafts.levels, np.asarray(values[2 * num :]))
            full = self.proposer.num_candidates
            try:
                made = self.proposer.trees_from_levels(
                    levels, [r for _, r, _, _ in kept], [d for _, _, d, _ in kept],
                    max(k for *_, k in kept),
                )  # fmt: skip
            except (RuntimeError, ValueError) as e:
                logger.warning("drafting failed, the next step decodes without drafts: %s", e)
                return {}
            for (request_id, _, _, k), tree in zip(kept, made, strict=True):
                trees[request_id] = tree if k == full else tree.first_candidates(k)
        return trees

    def _draft(
        self, view: DraftingView, hidden_states: dict[str, torch.Tensor]
    ) -> dict[str, DraftTree]:
        if len(view.running) > self.max_batch_size:
            return {}
        ready: list[tuple[Request, torch.Tensor, int]] = []  # (request, hidden, max depth)
        num_plain_rows = 0  # the rows of the requests that do not draft
        num_heads = self.proposer.num_heads
        for req in view.running:
            hidden = hidden_states.get(req.request_id)
            num_tokens = req.num_tokens
            if hidden is not None and req.num_computed_tokens == num_tokens - 1:
                remaining = min(
                    req.sampling_params.max_new_tokens - req.num_output_tokens,
                    view.max_model_len - num_tokens,
                )
                if remaining > 1:
                    ready.append((req, hidden, min(num_heads, remaining - 1)))
                    continue
            num_plain_rows += num_tokens - req.num_computed_tokens
        chosen = self._choose(ready, num_plain_rows, view)
        if not chosen:
            return {}
        inputs = [ProposalInput(r.request_id, r.all_token_ids, h, d) for r, h, d, _ in chosen]
        trees = self.proposer.propose(inputs, max(k for *_, k in chosen))
        full = self.proposer.num_candidates
        return {
            p.request_id: tree if k == full else tree.first_candidates(k)
            for p, (*_, k), tree in zip(inputs, chosen, trees, strict=True)
        }

    def _choose(
        self, ready: list[tuple[Request, _T, int]], num_plain_rows: int, view: DraftingView
    ) -> list[tuple[Request, _T, int, int]]:
        """Of the `ready` requests (request, its input, max depth), those that draft and the
        candidates each verifies, by the policy when there is one."""
        if not ready:
            return []
        methods = [Method.of(req.sampling_params) for req, _, _ in ready]
        full = self.proposer.num_candidates
        choice = dict.fromkeys(methods, full)
        refreshing: set[Method] = set()
        if self.policy is not None:
            max_plain_rows = view.max_num_batched_tokens - len(ready)
            choice = self.policy.choose(min(num_plain_rows, max_plain_rows), Counter(methods))
            if not choice:
                return []
            refreshing = set(self.policy.refreshing)
        chosen = []  # one full tree for each refreshing method
        for (req, payload, max_depth), m in zip(ready, methods, strict=True):
            if choice.get(m):
                chosen.append((req, payload, max_depth, full if m in refreshing else choice[m]))
                refreshing.discard(m)
        if self.policy is not None and self.policy.probing:
            chosen = chosen[:1]
        return chosen


@dataclass
class PendingDrafts:
    """Trees drafted on the device before the step's read: the requests and their candidates,
    the heads' levels, and `values` for the read (each request's last choice, the tokens
    chosen there, then the levels)."""

    chosen: list[tuple[Request, int]]
    levels: list[tuple[torch.Tensor, torch.Tensor]]
    values: torch.Tensor
