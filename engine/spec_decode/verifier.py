"""Verification of draft trees by exact match.

A request's tree was computed in one forward pass: row `first_row + node` holds the logits that
follow node `node` (row `first_row` follows the root, the request's last known token). A token is
chosen at every node at once, as the request would choose it after the drafts on the node's path
(every logit rule, seeded draws, details), so the step reads its choices from the device once.
The walk then starts at the root and descends to the child holding the node's choice while there
is one:

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
        `first_choice + n`, until a node's choice is held by none of its children, or failed."""
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
