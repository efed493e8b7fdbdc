"""Verification of draft trees by exact match.

A request's tree was computed in one forward pass: row `first_row + node` holds the logits that
follow node `node` (row `first_row` follows the root, the request's last known token). A token is
chosen at a node as the request would choose it after the drafts on the node's path (every logit
rule, seeded draws, details): at every node at once off a CPU, so the step reads its choices from
the device once, or only at the nodes the walk reaches on a CPU (`walk.chooses_lazily`). The
walk starts at the root and descends to the child holding the node's choice while there is one:

    accepted tokens  the drafts on the walked path (each equal to the request's own choice)
    bonus token      the choice at the last walked node, which no child holds

so a request gains `len(path) + 1` tokens, exactly the tokens it would have produced one by one.
A request whose choice fails at a walked node stops its walk with `error` set and gains nothing;
a failure at a node the walk does not reach does not matter.
The accepted nodes' K/V were written at the tree's slots; `accepted_slot_moves` lists the copies
that put them at consecutive sequence positions, where the scheduler's rollback expects them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.host_copy import to_device
from engine.kv_cache import KVCacheManager
from engine.request import Request
from engine.sampling.sampler import Choices, TokenLogprobs
from engine.spec_decode.tree import DraftTree


@dataclass
class Verification:
    """A draft tree being verified: the request, its tree, the logits row of its root, the index
    of the root's choice among the step's choices (node n's is `first_choice + n`), and the walk
    so far (`node`, the tokens chosen and their details, or the error that ended it)."""

    request: Request
    tree: DraftTree
    first_row: int
    first_choice: int = 0
    node: int = 0
    token_ids: list[int] = field(default_factory=list)
    details: list[TokenLogprobs | None] = field(default_factory=list)
    error: str | None = None

    @property
    def last_row(self) -> int:
        """The logits row of the last walked node (where the request's next step continues)."""
        return self.first_row + self.node

    def walked_rows(self) -> list[int]:
        """The logits rows of the walked nodes, root first."""
        return [self.first_row + node for node in (0, *self.tree.path(self.node))]

    def walk(self, choices: Choices) -> None:
        """Walk the tree from the root over `choices`, which hold the choice at node n at index
        `first_choice + n` (at least at the nodes the walk reaches), until a node's choice is
        held by none of its children, or failed."""
        while True:
            i = self.first_choice + self.node
            if choices.errors[i] is not None:
                self.error = choices.errors[i]
                return
            token = choices.token_ids[i]
            self.token_ids.append(token)
            self.details.append(choices.details[i])
            child = self.tree.child(self.node, token)
            if child is None:
                return
            self.node = child


def accepted_slot_moves(
    verifications: Sequence[Verification], kv: KVCacheManager
) -> tuple[list[int], list[int]]:
    """(src, dst) cache slots: the K/V of each walked node not already at its depth's position
    moves there (node n was written at position `num_computed_tokens + n`, its depth d belongs
    at `num_computed_tokens + d`). Failed walks move nothing."""
    src: list[int] = []
    dst: list[int] = []
    for v in verifications:
        if v.error is not None:
            continue
        request_id = v.request.request_id
        start = v.request.num_computed_tokens
        for depth, node in enumerate(v.tree.path(v.node), 1):
            if node != depth:
                src += kv.slot_mapping(request_id, start + node, start + node + 1)
                dst += kv.slot_mapping(request_id, start + depth, start + depth + 1)
    return src, dst


def last_choices_on_device(
    walks: Sequence[int | Verification],  # per drafting request: its one choice, or its tree
    choice_rows: Sequence[int],  # [C]: the logits row of each of the step's choices
    token_ids: torch.Tensor,  # [C] int64 on the device: the token chosen at each choice
) -> tuple[torch.Tensor, torch.Tensor]:  # [R] int64 choice indices, [R] int64 logits rows
    """Where each walk ends, computed on the device without reading it: the index of its last
    choice (a request's one choice; for a tree, its last walked node's, as `Verification.walk`
    descends over `token_ids`, failed choices included) and that choice's logits row. Costs
    one host-to-device copy (the trees' shapes) and a few operations per tree level."""
    num_choices = len(choice_rows)
    parents, drafts = list(range(num_choices)), [-1] * num_choices
    depths, slots = [0] * num_choices, [len(walks)] * num_choices
    num_levels = 0
    for r, walk in enumerate(walks):
        if isinstance(walk, int):
            slots[walk] = r
            continue
        root, tree = walk.first_choice, walk.tree
        slots[root] = r
        for j, (token, parent) in enumerate(zip(tree.token_ids, tree.parents, strict=True), 1):
            parents[root + j], drafts[root + j] = root + parent, token
            depths[root + j], slots[root + j] = tree.depths[j], r
        num_levels = max(num_levels, tree.depth)
    host = torch.tensor([parents, drafts, depths, slots, list(choice_rows)], dtype=torch.int64)
    parent, draft, depth, slot, rows = to_device(host, token_ids.device)
    # a node is walked when its draft is its parent's choice, and so on up to the root
    match = (token_ids[parent] == draft) | (depth == 0)
    walked = match
    for _ in range(num_levels):
        walked = match & walked[parent]
    index = torch.arange(num_choices, device=token_ids.device)
    key = torch.where(walked, depth * num_choices + index, -1)  # the deepest walked node wins
    last = torch.full((len(walks) + 1,), -1, dtype=torch.int64, device=token_ids.device)
    last = last.scatter_reduce_(0, slot, key, "amax")[:-1] % num_choices
    return last, rows[last]
