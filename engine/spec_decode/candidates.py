"""Candidate paths from a speculator's top-k tree, on the host (and the tree shape's checks).

The speculator's heads branch into the top `k_d` tokens at depth d, so depth d holds
`F_d = k_0 * ... * k_d` nodes in mixed-radix order of their ranks (the root not counted), and
leaf j's ancestor at depth d is node `j // (F_last / F_d)`. Candidates are leaves, picked by
their summed log-probabilities ("joint") or by `coverage_picks`, or any nodes, by `node_picks`.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from engine.config import SpeculativeConfig, bounds_of
from engine.host_copy import to_host


class TreeShape(NamedTuple):
    """Index arrays of a mixed-radix tree (`tree_shape`), read-only."""

    ancestors: np.ndarray  # [D, L]: each leaf's ancestor at every depth (the leaf itself last)
    common: np.ndarray  # [L, L]: ancestors two leaves share (depth + 1 for a leaf and itself)
    path_nodes: np.ndarray  # [L, D]: each leaf's path, as nodes numbered depth by depth
    node_paths: np.ndarray  # [nodes, D]: each node's path the same way, -1 below the node


@functools.lru_cache(maxsize=64)
def tree_shape(widths: tuple[int, ...]) -> TreeShape:
    """The index arrays of a mixed-radix tree with `widths[d]` nodes at depth d (the last: the
    leaves); nodes are numbered depth by depth from 0, the root not counted."""
    num_leaves = widths[-1]
    leaves = np.arange(num_leaves)
    ancestors = np.stack([leaves // (num_leaves // w) for w in widths])  # [D, L]
    common = (ancestors[:, :, None] == ancestors[:, None, :]).sum(0)  # [L, L]
    common[leaves, leaves] = len(widths) + 1
    starts = np.cumsum((0, *widths[:-1]))  # [D]: the first node of each depth
    path_nodes = np.ascontiguousarray((ancestors + starts[:, None]).T)  # [L, D]
    node_paths = np.full((sum(widths), len(widths)), -1, dtype=np.int64)  # [nodes, D]
    for d, width in enumerate(widths):
        # depth d's nodes are the leaves' ancestors there, each once (leaves are in node order)
        first = np.unique(ancestors[d], return_index=True)[1]  # [width]
        node_paths[starts[d] : starts[d] + width, : d + 1] = path_nodes[first, : d + 1]
    for array in (ancestors, common, path_nodes, node_paths):
        array.setflags(write=False)
    return TreeShape(ancestors, common, path_nodes, node_paths)


def node_picks(
    scores: Sequence[np.ndarray],  # per depth d: [B, F_d] summed log-probabilities
    n_candidates: int,
) -> np.ndarray:  # [B, N] int64 nodes, numbered depth by depth
    """The `n_candidates` nodes of highest summed log-probability, best first, ties to the
    shallower node, then to the lower node. A node's path probability is at most its parent's,
    so every node comes after its ancestors and each prefix of the picks is a tree: the tree of
    that many drafts that holds the most expected accepted drafts (each node's probability
    being the chance that its whole path is accepted)."""
    flat = np.concatenate(scores, axis=1)  # [B, nodes]
    return np.argsort(-flat, axis=1, kind="stable")[:, :n_candidates]


def coverage_picks(
    probs: Sequence[np.ndarray],  # per depth d: [B, F_d] float32 path probabilities
    n_candidates: int,
) -> np.ndarray:  # [B, N] int64 leaf indices, in the order picked
    """Greedy tree building: `probs[d]` holds the probability of each depth-d node's whole
    path under the draft distributions (the exponential of its summed log-probabilities), which
    is the probability that the node is accepted. A set of paths is then expected to gain the
    sum of those probabilities over the nodes it contains; each pick is the leaf whose path adds
    the most to that sum, ties to the lower leaf index. Unlike the best joint paths, which crowd
    behind a confident first token, this spreads the paths over the first tokens when the first
    head is unsure and deepens them when it is not.

    A leaf's gain is the sum, in depth order in float32, of its ancestors' probabilities from
    the first ancestor no picked leaf shares down to itself (a picked leaf shares an ancestor
    with it from the root down to their last common one); a picked leaf's gain is -1.
    """
    depth = len(probs)
    batch, num_leaves = probs[-1].shape
    shape = tree_shape(tuple(level.shape[1] for level in probs))
    ancestors, common = shape.ancestors, shape.common
    leaf_probs = [level[:, a] for level, a in zip(probs, ancestors, strict=True)]  # [B, L] each
    # gains[m]: a leaf's gain when its first m ancestors are covered; m = depth + 1 marks a
    # picked leaf (`tree_shape` gives a leaf depth + 1 common ancestors with itself).
    gains = np.empty((depth + 2, batch, num_leaves), dtype=np.float32)  # [D + 2, B, L]
    for m in range(depth):
        gains[m] = leaf_probs[m]
        for p in leaf_probs[m + 1 :]:
            gains[m] += p
    gains[depth] = 0.0
    gains[depth + 1] = -1.0
    flat = gains.reshape(-1)
    cells = np.arange(batch * num_leaves).reshape(batch, num_leaves)  # [B, L]
    covered = np.zeros((batch, num_leaves), dtype=np.int64)  # [B, L]: covered ancestors
    picks = np.empty((batch, n_candidates), dtype=np.int64)  # [B, N]
    for n in range(n_candidates):
        pick = flat.take(covered * (batch * num_leaves) + cells).argmax(-1)  # [B]: first maximum
        picks[:, n] = pick
        np.maximum(covered, common[pick], out=covered)
    return picks


class NodeBudget:
    """Drafting only the nodes `node_picks` can pick among its first `num_drafts`, on the host.

    A head scores the children of the nodes worth expanding only: a node whose rank, in
    `node_picks`' order over the nodes known so far, is `num_drafts - 1` or more has no child
    among the first `num_drafts` picks (a child comes after its parent, and more known nodes
    only push a rank down), and every picked node's parent is expanded. So the first
    `num_drafts` picks of the `levels` kept here, where nodes never drafted are NaN (ranked
    last) with token -1, are those of the whole tree.
    """

    def __init__(self, batch: int, num_drafts: int) -> None:
        self.batch = batch
        self.num_drafts = num_drafts
        self.expanded = np.arange(batch)  # [E]: the nodes the next head scores, depth by depth
        self.levels: list[tuple[np.ndarray, np.ndarray]] = []  # as `pick_candidates` takes them
        self._scores: list[np.ndarray] = []  # per depth: [B, F_d] summed log-probabilities

    def add(self, logprobs: np.ndarray, token_ids: np.ndarray, last: bool) -> np.ndarray | None:
        """A head's top k [E, k] (float32 log-probabilities, int64 token ids) for the expanded
        nodes; unless `last`, their children worth expanding become the expanded nodes. Returns
        those children's rows in [E * k], or None when every child is worth expanding."""
        k = logprobs.shape[1]
        parents = self._scores[-1] if self._scores else np.zeros((self.batch, 1), np.float32)
        num_nodes = parents.size  # at this depth, in all the batch
        full_logprobs = np.full((num_nodes, k), np.nan, dtype=np.float32)  # [B * F, k]
        full_ids = np.full((num_nodes, k), -1, dtype=np.int64)
        full_logprobs[self.expanded] = logprobs
        full_ids[self.expanded] = token_ids
        self.levels.append((full_logprobs, full_ids))
        scores = parents[:, :, None] + full_logprobs.reshape(self.batch, -1, k)  # [B, F, k]
        self._scores.append(scores.reshape(self.batch, -1))
        if last:
            return None
        children = (self.expanded[:, None] * k + np.arange(k)).reshape(-1)  # [E * k]
        flat = np.concatenate(self._scores, axis=1)  # [B, nodes]
        ranks = np.argsort(np.argsort(-flat, axis=1, kind="stable"), axis=1, kind="stable")
        worth = ranks[:, -self._scores[-1].shape[1] :] < self.num_drafts - 1  # [B, F * k]
        keep = worth.reshape(-1)[children]  # [E * k]
        if keep.all():
            self.expanded = children
            return None
        rows = np.flatnonzero(keep)
        self.expanded = children[rows]
        return rows


def num_candidates(top_k: Sequence[int], n_candidates: int, selection: str) -> int:
    """How many candidates `pick_candidates` returns: `n_candidates` paths, or with "nodes"
    selection the drafts that many paths hold (`n_candidates * len(top_k)`), at most the
    tree's nodes."""
    if selection != "nodes":
        return n_candidates
    return min(n_candidates * len(top_k), sum(itertools.accumulate(top_k, operator.mul)))


def pick_candidates(
    levels: Sequence[tuple[np.ndarray, np.ndarray]],  # per depth d: [B * F_(d-1), k_d] each
    batch: int,
    top_k: Sequence[int],
    n_candidates: int,
    selection: str,
    num_drafts: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:  # [B, N, D] int64 paths, [B, N] float32 scores
    """The N = `num_candidates(top_k, n_candidates, selection)` candidates of a top-k tree whose
    heads' top-k float32 log-probabilities and int64 token ids are `levels`, depth by depth,
    parents in mixed-radix order (`MLPSpeculator.draft_candidates` makes them): each
    candidate's tokens and summed log-probability (float32, summed in depth order). "joint"
    takes the leaves of highest sum, "coverage" the leaves `coverage_picks` picks, "nodes" the
    nodes `node_picks` picks (at most `num_drafts`, when given), each as its path padded with
    -1 below the node."""
    widths = tuple(itertools.accumulate(top_k, operator.mul))  # [D]
    scores = np.zeros((batch, 1), dtype=np.float32)  # [B, F]
    prefix_scores: list[np.ndarray] = []  # per depth: [B, F_d] summed log-probabilities
    for (logprobs, _), k, width in zip(levels, top_k, widths, strict=True):
        scores = (scores[:, :, None] + logprobs.reshape(batch, -1, k)).reshape(batch, width)
        prefix_scores.append(scores)  # [B, F_d]
    all_tokens = np.concatenate([ids.reshape(batch, -1) for _, ids in levels], 1)  # [B, nodes]
    rows = np.arange(batch)[:, None]  # [B, 1]
    shape = tree_shape(widths)
    if selection == "nodes":
        count = num_candidates(top_k, n_candidates, selection)
        best = node_picks(prefix_scores, min(count, num_drafts or count))  # [B, N]
        nodes = shape.node_paths[best]  # [B, N, D], -1 below each node
        paths = np.where(nodes >= 0, all_tokens[rows[:, :, None], nodes], -1)  # [B, N, D]
        return paths, np.concatenate(prefix_scores, axis=1)[rows, best]
    if selection == "coverage":
        best = coverage_picks([np.exp(level) for level in prefix_scores], n_candidates)  # [B, N]
    else:
        best = np.argsort(-scores, axis=1, kind="stable")[:, :n_candidates]  # [B, N] leaves
    paths = all_tokens[rows[:, :, None], shape.path_nodes[best]]  # [B, N, D]
    return paths, scores[rows, best]


def check_selection(selection: str) -> None:
    """Raise ValueError unless `selection` is a candidate selection: the rule declared on
    `SpeculativeConfig.candidate_selection`, applied to callers that pass no config."""
    bounds_of(SpeculativeConfig, "candidate_selection").check("selection", selection)


def check_tree_shape(n_predict: int, top_k: Sequence[int], n_candidates: int) -> None:
    """Raise ValueError unless `top_k` has one positive entry per head and `n_candidates` is
    between 1 and the number of leaves (the product of `top_k`)."""
    if len(top_k) != n_predict:
        raise ValueError(
            f"top_k_tokens_per_head {list(top_k)} must have n_predict ({n_predict}) entries"
        )
    if any(k < 1 for k in top_k):
        raise ValueError(f"top_k_tokens_per_head {list(top_k)} must be positive")
    if not 1 <= n_candidates <= math.prod(top_k):
        raise ValueError(
            f"n_candidates ({n_candidates}) must be between 1 and the number of tree leaves "
            f"({math.prod(top_k)} for top_k_tokens_per_head {list(top_k)})"
        )


def levels_on_host(
    levels: Sequence[tuple[torch.Tensor, torch.Tensor]],  # per head: [B * F, k] log-probs, ids
) -> list[tuple[np.ndarray, np.ndarray]]:  # the same as float32 and int64 arrays
    """The heads' top-k log-probabilities and token ids on the host: views of CPU tensors, else
    one device-to-host copy of them all (`levels_values`, `levels_from_values`)."""
    if levels[0][0].device.type == "cpu":
        return [(logprobs.float().numpy(), ids.numpy()) for logprobs, ids in levels]
    return levels_from_values(levels, to_host(levels_values(levels)).numpy())


def levels_values(levels: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The levels as one flat float64 tensor on their device (float64 holds both exactly)."""
    return torch.cat([t.flatten().double() for level in levels for t in level])


def levels_from_values(
    levels: Sequence[tuple[torch.Tensor, torch.Tensor]],  # their shapes are read
    values: np.ndarray,  # `levels_values(levels)` on the host
) -> list[tuple[np.ndarray, np.ndarray]]:  # as `levels_on_host`
    """`levels_on_host` from `levels_values` read on the host."""
    arrays = []
    offset = 0
    for logprobs, _ in levels:
        size = logprobs.numel()
        pair = values[offset : offset + 2 * size].reshape(2, *logprobs.shape)
        arrays.append((pair[0].astype(np.float32), pair[1].astype(np.int64)))
        offset += 2 * size
    return arrays
