"""A token tree of draft continuations, as the base model verifies it in one forward pass.

Node 0 is the root: the request's last known token, whose K/V is not yet computed. Nodes 1..n
are drafts, flattened so that every node comes after its parent (candidate 0's path first, then
the nodes other candidates add: fms-extras' `flatten_batch` order). So any prefix of the nodes is
again a tree, which lets the scheduler trim drafts to its token budget.

    candidates  a b c / a b d / a e f   (under root r)
    nodes       r a b c d e f           parents  - 0 1 2 2 1 5     depths 0 1 2 3 3 2 3

The verify step writes node j's K/V at cache position `num_computed_tokens + j` with RoPE position
`num_computed_tokens + depth(j)`, and node j attends to the cached context plus its ancestors
and itself (`attention_mask`). Accepting a path moves its K/V to consecutive positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DraftTree:
    """Draft nodes 1..n below the root: `token_ids[j - 1]` with parent `parents[j - 1]` (< j)."""

    token_ids: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    leaves: tuple[int, ...] = ()
    """The last node of each candidate path, best candidate first (for acceptance statistics;
    empty when the tree was not built from candidates)."""
    depths: tuple[int, ...] = field(init=False, repr=False)  # of nodes 0..n (root: 0)
    _children: tuple[dict[int, int], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.parents):
            raise ValueError("token_ids and parents differ in length")
        depths = [0]
        children: list[dict[int, int]] = [{}]
        for j, (token, parent) in enumerate(zip(self.token_ids, self.parents, strict=True), 1):
            if not 0 <= parent < j:
                raise ValueError(f"node {j}: parent {parent} does not precede it")
            if token in children[parent]:
                raise ValueError(f"node {j}: token {token} repeats a sibling")
            children[parent][token] = j
            children.append({})
            depths.append(depths[parent] + 1)
        object.__setattr__(self, "depths", tuple(depths))
        object.__setattr__(self, "_children", tuple(children))

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]], max_depth: int | None = None) -> DraftTree:
        """Merge candidate paths (best first; each the tokens after the root) into one tree,
        cutting every path to `max_depth` tokens."""
        token_ids: list[int] = []
        parents: list[int] = []
        leaves: list[int] = []
        index: dict[tuple[int, ...], int] = {(): 0}
        for path in paths:
            path = tuple(int(t) for t in path[:max_depth])
            for d in range(1, len(path) + 1):
                if path[:d] not in index:
                    token_ids.append(path[d - 1])
                    parents.append(index[path[: d - 1]])
                    index[path[:d]] = len(token_ids)
            leaves.append(index[path])
        return cls(tuple(token_ids), tuple(parents), tuple(leaves))

    @classmethod
    def chain(cls, token_ids: Sequence[int]) -> DraftTree:
        """A single path (one candidate)."""
        n = len(token_ids)
        return cls(tuple(token_ids), tuple(range(n)), (n,) if n else ())

    @property
    def num_drafts(self) -> int:
        return len(self.token_ids)

    @property
    def depth(self) -> int:
        """The longest path's number of drafts."""
        return max(self.depths)

    def truncate(self, num_drafts: int) -> DraftTree:
        """The tree of the first `num_drafts` draft nodes (and the candidates wholly in it)."""
        if num_drafts >= self.num_drafts:
            return self
        leaves = tuple(leaf for leaf in self.leaves if leaf <= num_drafts)
        return DraftTree(self.token_ids[:num_drafts], self.parents[:num_drafts], leaves)

    def first_candidates(self, num_candidates: int) -> DraftTree:
        """The tree of the first `num_candidates` candidate paths (nodes come in candidate
        order, so it is a prefix of this one)."""
        leaves = self.leaves[:num_candidates]
        return self.truncate(max(leaves, default=0))

    def match_lengths(self, token_ids: list[int]) -> list[int]:
        """For each candidate, how many of its drafts equal the start of `token_ids`."""
        lengths = []
        for leaf in self.leaves:
            path = [self.token_ids[node - 1] for node in self.path(leaf)]
            n = 0
            while n < min(len(path), len(token_ids)) and path[n] == token_ids[n]:
                n += 1
            lengths.append(n)
        return lengths

    def child(self, node: int, token_id: int) -> int | None:
        """The child of `node` holding `token_id`, if any."""
        return self._children[node].get(token_id)

    def path(self, node: int) -> list[int]:
        """The nodes from the root's first child down to `node` (empty for the root)."""
        nodes = []
        while node:
            nodes.append(node)
            node = self.parents[node - 1]
        return nodes[::-1]

    def path_token_ids(self) -> list[list[int]]:
        """For each node 0..n, the drafts on the path from the root's first child down to it
        (the root's: empty)."""
        paths: list[list[int]] = [[]]
        for token, parent in zip(self.token_ids, self.parents, strict=True):
            paths.append([*paths[parent], token])
        return paths

    def attention_mask(self) -> torch.Tensor:  # [n+1, n+1] bool: row j sees its ancestors + j
        import torch  # here, so that the scheduler's modules import without torch

        n = self.num_drafts + 1
        rows = [[False] * n for _ in range(n)]  # built on the host: one tensor op, not n
        rows[0][0] = True
        for j, parent in enumerate(self.parents, 1):
            row = rows[j]
            row[: parent + 1] = rows[parent][: parent + 1]  # the parent's ancestors precede it
            row[j] = True
        return torch.tensor(rows, dtype=torch.bool)
