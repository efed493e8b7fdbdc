"""Which requests draft after a step, how many candidates they verify, and their trees.

After each step the engine hands the `Drafter` the final-norm hidden state each request's last
token was chosen from. A request may draft, greedy or sampled (sampled tokens are keyed draws,
see `sampling.keyed_draw`), when it is exactly one token behind (its last token has no K/V yet:
it becomes the tree's root) and has room for at least one draft, while at
most `max_batch_size` requests run. The policy (when given) chooses how many candidates pay this
step, possibly none, and may ask for a probe: one request drafts, to measure.
"""

from __future__ import annotations

import time
from collections import Counter

import torch

from engine.request import Request
from engine.scheduler import Scheduler
from engine.spec_decode.policy import Method, SpeculationPolicy
from engine.spec_decode.proposer import ProposalInput, Proposer
from engine.spec_decode.tree import DraftTree


class Drafter:
    def __init__(
        self, proposer: Proposer, policy: SpeculationPolicy | None, max_batch_size: int
    ) -> None:
        """Without a `policy` every drafting request verifies the proposer's whole tree."""
        self.proposer = proposer
        self.policy = policy
        self.max_batch_size = max_batch_size
        self._trees: dict[str, DraftTree] = {}  # proposed for the next step
        self._propose_seconds = 0.0  # drafting for the coming step, part of its cost

    def take_trees(self) -> dict[str, DraftTree]:
        """The trees proposed for the step about to run (the scheduler may truncate them)."""
        trees, self._trees = self._trees, {}
        return trees

    def observe_step(self, num_rows: int, seconds: float, num_trees: int) -> None:
        """A step of `num_rows` rows verifying `num_trees` trees took `seconds` (its drafting,
        timed by `propose`, is added here)."""
        if self.policy is not None:
            self.policy.observe_step(num_rows, seconds + self._propose_seconds, num_trees)

    def observe_tree(self, tree: DraftTree, token_ids: list[int], method: Method) -> None:
        """A verified tree of a request of `method` and the tokens the request gained from it."""
        if self.policy is not None:
            self.policy.observe_tree(tree, token_ids, method)

    def propose(
        self,
        scheduler: Scheduler,
        hidden_states: dict[str, torch.Tensor],  # request id -> [hidden]
    ) -> dict[str, tuple[int, ...]]:
        """Draft trees for the next step; returns each drafting request's draft token ids (in
        tree order) for `Scheduler.update_draft_token_ids`."""
        start = time.perf_counter()
        self._trees = self._draft(scheduler, hidden_states)
        self._propose_seconds = time.perf_counter() - start
        return {request_id: tree.token_ids for request_id, tree in self._trees.items()}

    def _draft(
        self, scheduler: Scheduler, hidden_states: dict[str, torch.Tensor]
    ) -> dict[str, DraftTree]:
        if scheduler.num_running > self.max_batch_size:
            return {}
        ready: list[tuple[Request, torch.Tensor, int]] = []  # (request, hidden, max depth)
        num_plain_rows = 0  # the rows of the requests that do not draft
        num_heads = self.proposer.num_heads
        for req in scheduler.running:
            hidden = hidden_states.get(req.request_id)
            num_tokens = req.num_tokens
            if hidden is not None and req.num_computed_tokens == num_tokens - 1:
                remaining = min(
                    req.sampling_params.max_new_tokens - req.num_output_tokens,
                    scheduler.max_model_len - num_tokens,
                )
                if remaining > 1:
                    ready.append((req, hidden, min(num_heads, remaining - 1)))
                    continue
            num_plain_rows += num_tokens - req.num_computed_tokens
        if not ready:
            return {}
        methods = [Method.of(req.sampling_params) for req, _, _ in ready]
        full = self.proposer.num_candidates
        choice = dict.fromkeys(methods, full)
        refreshing: set[Method] = set()
        if self.policy is not None:
            max_plain_rows = scheduler.config.max_num_batched_tokens - len(ready)
            choice = self.policy.choose(min(num_plain_rows, max_plain_rows), Counter(methods))
            if not choice:
                return {}
            refreshing = set(self.policy.refreshing)
        chosen = []  # (input, candidates): one full tree for each refreshing method
        for (req, hidden, max_depth), m in zip(ready, methods, strict=True):
            if choice.get(m):
                p = ProposalInput(req.request_id, req.all_token_ids, hidden, max_depth)
                chosen.append((p, full if m in refreshing else choice[m]))
                refreshing.discard(m)
        if self.policy is not None and self.policy.probing:
            chosen = chosen[:1]
        trees = self.proposer.propose([p for p, _ in chosen], max(k for _, k in chosen))
        return {
            p.request_id: tree if k == full else tree.first_candidates(k)
            for (p, k), tree in zip(chosen, trees, strict=True)
        }
