"""Verification of draft trees by exact match.

A request's tree was computed in one forward pass: row `first_row + node` holds the logits that
follow node `node` (row `first_row` follows the root, the request's last known token). The walk
chooses a token from the root's row exactly as a plain step would (every logit rule, seeded draws,
details), descends to the child holding that token while there is one, and chooses again:

    accepted tokens  the drafts on the walked path (each equal to the request's own choice)
    bonus token      the choice at the last walked node, which no child holds

so a request gains `len(path) + 1` tokens, exactly the tokens it would have produced one by one.
A request whose choice fails stops its walk with `error` set and gains nothing.
The accepted nodes' K/V were written at the tree's slots; `accepted_slot_moves` lists the copies
that put them at consecutive sequence positions, where the scheduler's rollback expects them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.kv_cache import KVCacheManager
from engine.request import Request
from engine.sampling.sampler import Choices, TokenLogprobs
from engine.spec_decode.tree import DraftTree

ChooseFn = Callable[[list[int], list[Request], list[list[int]]], Choices]
"""(logits rows, their requests, tokens already chosen for each this step) -> one token per row,
its details (None unless the request asks for logprobs) and its error (None unless it failed)."""


@dataclass
class Verification:
    """A draft tree being verified: the request, its tree, the logits row of its root, and the
    walk so far (`node`, the tokens chosen and their details, or the error that ended it)."""

    request: Request
    tree: DraftTree
    first_row: int
    node: int = 0
    token_ids: list[int] = field(default_factory=list)
    details: list[TokenLogprobs | None] = field(default_factory=list)
    error: str | None = None

    @property
    def last_row(self) -> int:
        """The logits row of the last walked node (where the request's next step continues)."""
        return self.first_row + self.node


def walk_trees(verifications: Sequence[Verification], choose: ChooseFn) -> None:
    """Walk every tree from its root, one depth per `choose` call over all trees still walking,
    until each has chosen a token that no child of its node holds, or failed."""
    active = list(verifications)
    while active:
        choices = choose(
            [v.last_row for v in active],
            [v.request for v in active],
            [v.token_ids for v in active],
        )
        still_active = []
        picked = zip(active, choices.token_ids, choices.details, choices.errors, strict=True)
        for v, token, detail, error in picked:
            if error is not None:
                v.error = error
                continue
            v.token_ids.append(token)
            v.details.append(detail)
            child = v.tree.child(v.node, token)
            if child is not None:
                v.node = child
                still_active.append(v)
        active = still_active


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
