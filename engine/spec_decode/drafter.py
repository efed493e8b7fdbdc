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
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.request import Request
from engine.spec_decode.policy import Method, SpeculationPolicy
from engine.spec_decode.proposer import ProposalInput, Proposer
from engine.spec_decode.tree import DraftTree


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
        view: DraftingView,
        hidden_states: dict[str, torch.Tensor],  # request id -> [hidden]
    ) -> dict[str, DraftTree]:
        """The draft tree of each request that drafts for the next step (for
        `Scheduler.update_draft_trees`)."""
        start = time.perf_counter()
        trees = self._draft(view, hidden_states)
        self._propose_seconds = time.perf_counter() - start
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
        if not ready:
            return {}
        methods = [Method.of(req.sampling_params) for req, _, _ in ready]
        full = self.proposer.num_candidates
        choice = dict.fromkeys(methods, full)
        refreshing: set[Method] = set()
        if self.policy is not None:
            max_plain_rows = view.max_num_batched_tokens - len(ready)
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
