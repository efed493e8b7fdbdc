"""One step's model inputs, built from the scheduler's output: each request's chunk of known
tokens, or its last token and draft tree to verify, and the logits rows tokens are chosen from."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.kv_cache import KVCacheManager
from engine.request import Request
from engine.sampling.greedy_choice import is_plain_greedy, masked_eos
from engine.sampling.prompt_logprobs import PromptLogprobs
from engine.scheduler import SchedulerOutput
from engine.spec_decode.verifier import Verification
from engine.step_io import SequenceInput


@dataclass
class StepBatch:
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


def build_batch(
    sched: SchedulerOutput,
    kv: KVCacheManager,
    prompt_logprobs: PromptLogprobs,
    rows_read_whole: bool = False,
) -> StepBatch:
    """One `SequenceInput` per scheduled request: its root token and drafts (a tree to
    verify), or a chunk of known tokens whose last row is sampled when it reaches the
    request's last known token, plus the rows prompt logprobs need. A sequence is
    `argmax_only` when its request is plain greedy (`is_plain_greedy`: each row is read only for
    its argmax, after the ids `masked_eos` gives, its `maskable_ids`, are masked), it has no
    prompt logprobs rows, and not `rows_read_whole` (the caller reads every row whole, e.g. to
    show observers)."""
    batch = StepBatch()
    for req in sched.scheduled_requests:
        argmax_only = not rows_read_whole and is_plain_greedy(req.sampling_params)
        maskable_ids = masked_eos(req, 0)
        n = sched.num_scheduled_tokens[req.request_id]
        start = req.num_computed_tokens
        block_table = kv.block_table(req.request_id)
        tree = sched.scheduled_draft_trees.get(req.request_id)
        if tree is not None:
            v = Verification(req, tree, batch.num_rows, len(batch.choice_rows))
            for node, path in enumerate(tree.path_token_ids()):
                batch.add_choice(batch.num_rows + node, req, path)
            batch.verifying.append(v)
            batch.num_rows += n
            batch.inputs.append(
                SequenceInput(
                    token_ids=[req.all_token_ids[start], *tree.token_ids],
                    num_computed_tokens=start,
                    block_table=block_table,
                    positions=[start + d for d in tree.depths],
                    tree_mask=tree.attention_mask(),
                    logits_indices=list(range(n)),
                    argmax_only=argmax_only,
                    maskable_ids=maskable_ids,
                )
            )
            continue
        indices = prompt_logprobs.logits_indices(req, start, n)
        if indices:
            positions = [start + j + 1 for j in indices]
            batch.prompt_rows.append((req, batch.num_rows, positions))
            argmax_only = False
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
                argmax_only=argmax_only,
                maskable_ids=maskable_ids,
            )
        )
    return batch


def count_prefill_tokens(sched: SchedulerOutput) -> int:
    """The scheduled tokens of requests catching up on known tokens (a prompt, or a
    recomputation after a preemption); the others are one token behind with output tokens,
    and compute that token plus their drafts."""
    return sum(
        sched.num_scheduled_tokens[r.request_id]
        for r in sched.scheduled_requests
        if not (r.num_output_tokens and r.num_computed_tokens == r.num_tokens - 1)
    )
