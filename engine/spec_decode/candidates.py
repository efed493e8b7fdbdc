"""Candidate paths from a speculator's top-k tree, on the host.

The speculator's heads branch into the top `k_d` tokens at depth d, so depth d holds
`F_d = k_0 * ... * k_d` nodes in mixed-radix order of their ranks (the root not counted), and
leaf j's ancestor at depth d is node `j // (F_last / F_d)`. Candidates are leaves, picked by
their summed log-probabilities ("joint") or by `coverage_picks`, or any nodes, by `node_picks`.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


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


def num_candidates(top_k: Sequence[int], n_candidates: int, selection: str) -> int:
    """How many candidates `pick_candidates` returns: `n_candidates` paths, or with "nodes"
    selection the drafts that many paths hold (`n_candidates * len(top_k)`), at most the
    tree's nodes."""
    if selection != "nodes":
        return n_candidates
    return min(n_candidates * len(top_k), sum(itertools.accumulate(top_k, operator.mul)))


def pick_candidates(
    host: np.ndarray,  # float64: per depth d, [B * F_(d-1), k_d] log-probs, then as many ids
    batch: int,
    top_k: Sequence[int],
    n_candidates: int,
    selection: str,
) -> tuple[np.ndarray, np.ndarray]:  # [B, N, D] int64 paths, [B, N] float32 scores
    """The N = `num_candidates(top_k, n_candidates, selection)` candidates of a top-k tree whose
    heads' top-k log-probabilities and token ids are `host`, depth by depth, parents in
    mixed-radix order (`MLPSpeculator.draft_candidates` makes it): each candidate's tokens and
    summed log-probability (float32, summed in depth order). "joint" takes the leaves of highest
    sum, "coverage" the leaves `coverage_picks` picks, "nodes" the nodes `node_picks` picks,
    each as its path padded with -1 below the node."""
    widths = tuple(itertools.accumulate(top_k, operator.mul))  # [D]
    scores = np.zeros((batch, 1), dtype=np.float32)  # [B, F]
    prefix_scores: list[np.ndarray] = []  # per depth: [B, F_d] summed log-probabilities
    node_tokens: list[np.ndarray] = []  # per depth: [B * F_d] token ids
    offset = 0
    for k, width in zip(top_k, widths, strict=True):
        size = batch * width
        step = host[offset : offset + size].astype(np.float32).reshape(batch, -1, k)
        scores = (scores[:, :, None] + step).reshape(batch, width)
        prefix_scores.append(scores)  # [B, F_d]
        node_tokens.append(host[offset + size : offset + 2 * size].astype(np.int64))
        offset += 2 * size
    all_tokens = np.concatenate([t.reshape(batch, -1) for t in node_tokens], 1)  # [B, nodes]
    rows = np.arange(batch)[:, None]  # [B, 1]
    shape = tree_shape(widths)
    if selection == "nodes":
        best = node_picks(prefix_scores, num_candidates(top_k, n_candidates, selection))  # [B, N]
        nodes = shape.node_paths[best]  # [B, N, D], -1 below each node
        paths = np.where(nodes >= 0, all_tokens[rows[:, :, None], nodes], -1)  # [B, N, D]
        return paths, np.concatenate(prefix_scores, axis=1)[rows, best]
    if selection == "coverage":
        best = coverage_picks([np.exp(level) for level in prefix_scores], n_candidates)  # [B, N]
    else:
        best = np.argsort(-scores, axis=1, kind="stable")[:, :n_candidates]  # [B, N] leaves
    paths = all_tokens[rows[:, :, None], shape.path_nodes[best]]  # [B, N, D]
    return paths, scores[rows, best]
