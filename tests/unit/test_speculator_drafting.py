"""Drafting with the MLP speculator: `MLPSpeculator.draft_candidates` (and the proposer that
serves it) against a plain per-node reference of the same maths.

Oracle: `_reference_candidates` walks the top-k tree one node at a time in float64, from the
recurrence in mlp_speculator.py's docstring (`s_{i+1} = GELU(ln_i(proj_i(s_i) + (alpha / beta) *
emb_i(tok_i)))`, `logits_i = head_i(s_{i+1})`), and picks candidates by the rules the
`draft_candidates` and `coverage_picks` docstrings state, with none of the module's
batching, shared projections or host-side bookkeeping; where the drafter's projections and
heads are `Int8Head`s, with their weights and their inputs quantised as those read them. Every
test runs twice: on float32 CPU tensors drafting uses the fused C kernels of a stage and of a
head's top k; with those turned off it runs the ATen ops that other devices use.
"""

from __future__ import annotations

import copy
import math
from typing import cast

import numpy as np
import pytest
import torch
from torch import nn

from engine.kernels.cpu import load_cpu_kernels
from engine.kernels.rows import load_rows_gemm
from engine.spec_decode import mlp_speculator
from engine.spec_decode.candidates import coverage_picks, node_picks, num_candidates, tree_shape
from engine.spec_decode.fused_drafting import FusedNodeDrafting, Int8Head
from engine.spec_decode.mlp_speculator import MLPSpeculator
from engine.spec_decode.proposer import MLPProposer, ProposalInput, use_engine_linears
from engine.spec_decode.tree import DraftTree
from tests.reference import random_speculator

VOCAB, EMB_DIM, INNER_DIM = 120, 24, 16


@pytest.fixture(autouse=True, params=["fused", "aten"])
def drafting_ops(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which ops draft on the CPU: the fused C kernels, or the ATen ops of other devices."""
    if request.param == "aten":
        monkeypatch.setattr(mlp_speculator, "fused_kernels", lambda state: None)
    else:
        assert mlp_speculator.fused_kernels(torch.zeros(1)) is not None
    return str(request.param)


def _param(module: nn.Module, name: str = "weight") -> torch.Tensor:
    return cast(torch.Tensor, getattr(module, name))


def _speculator(
    n_predict: int = 3, tie: bool = False, scale: bool = False, seed: int = 0
) -> MLPSpeculator:
    return random_speculator(VOCAB, n_predict, tie, scale, seed, EMB_DIM, INNER_DIM)


def _reference_and_copy(
    tie: bool, scale: bool, restricted: bool, seed: int
) -> tuple[MLPSpeculator, MLPSpeculator, torch.Tensor | None]:
    """A random speculator, a copy of it, and when `restricted` the 40 tokens the copy drafts
    from (its draft vocabulary; None otherwise)."""
    reference = _speculator(tie=tie, scale=scale, seed=seed)
    model = copy.deepcopy(reference)
    vocab = None
    if restricted:
        vocab = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed + 1))[:40]
        model.restrict_vocabulary(vocab)
    return reference, model, vocab


@torch.no_grad()
def _as_drafted(
    reference: MLPSpeculator, model: MLPSpeculator, vocab: torch.Tensor | None = None
) -> MLPSpeculator:
    """`reference` with the weights `model` multiplies by: its `Int8Head` projections and heads
    dequantised (rows `vocab` of the full heads where `model` drafts from that subset)."""
    drafted = copy.deepcopy(reference)
    for i, (proj, head) in enumerate(zip(model.proj, model.head, strict=True)):
        if isinstance(proj, Int8Head):
            _param(drafted.proj[i]).copy_(proj.dequantized())
        if isinstance(head, Int8Head):
            target = _param(drafted.head[i])
            target[slice(None) if vocab is None else vocab] = head.dequantized()
    return drafted


def _int8_heads(model: MLPSpeculator) -> bool:
    return any(isinstance(m, Int8Head) for m in (*model.proj, *model.head))


def _as_int8_input(v: torch.Tensor) -> torch.Tensor:
    """v [d] float64 as an `Int8Head` reads its input row: int8 with scale max |v| / 127."""
    scale = v.abs().max() / 127
    return v if scale == 0 else torch.round(v / scale).clamp(-127, 127) * scale


@torch.no_grad()
def _reference_tree(
    model: MLPSpeculator,
    state: torch.Tensor,  # [emb_dim]
    token: int,
    top_k: tuple[int, ...],
    vocab: list[int] | None,
    int8_inputs: bool = False,
) -> list[list[tuple[tuple[int, ...], float]]]:
    """Per depth, every node of the top-k tree as (path, summed log-probability), in mixed-radix
    order of the ranks; `vocab` (base ids) restricts the heads, whose weights are the full ones.
    With `int8_inputs` the projections and heads read their inputs as `Int8Head`s do."""

    def read(v: torch.Tensor) -> torch.Tensor:
        return _as_int8_input(v) if int8_inputs else v

    cfg = model.config
    beta = 0.5 ** (0.5 / cfg.n_predict)
    scale = math.sqrt((1 - beta**2) * cfg.inner_dim / 2) / beta
    s0 = state.double()
    if cfg.scale_input:
        s0 = s0 / torch.sqrt(s0.pow(2).mean() + 1e-6) / math.sqrt(2)
    columns = list(range(cfg.vocab_size)) if vocab is None else vocab
    # (path, score, the state the node's children read, the node's token)
    frontier: list[tuple[tuple[int, ...], float, torch.Tensor, int]] = [((), 0.0, s0, token)]
    levels = []
    for i, k in enumerate(top_k):
        proj, emb = _param(model.proj[i]).double(), _param(model.emb[i]).double()
        ln_w, ln_b = _param(model.ln[i]).double(), _param(model.ln[i], "bias").double()
        head = _param(model.head[i]).double()[columns]  # [V', inner]
        children = []
        for path, score, s, tok in frontier:
            x = proj @ read(s) + scale * emb[tok]
            x = ln_w * x / torch.sqrt(x.pow(2).mean() + 1e-6) + ln_b
            s_next = 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
            logprobs = (head @ read(s_next)).log_softmax(-1).tolist()
            ranked = sorted(range(len(columns)), key=lambda c: (-logprobs[c], c))[:k]
            for c in ranked:
                t = columns[c]
                children.append(((*path, t), score + logprobs[c], s_next, t))
        levels.append([(path, score) for path, score, _, _ in children])
        frontier = children
    return levels


def _reference_candidates(
    levels: list[list[tuple[tuple[int, ...], float]]], n: int, selection: str
) -> list[tuple[tuple[int, ...], float]]:
    """The candidates by `selection`'s rule, in the order picked: `n` leaves, or for "nodes"
    the `n * depth` nodes (at most all) of highest score, ties to the shallower, then earlier."""
    leaves = levels[-1]
    if selection == "nodes":
        nodes = sorted(
            ((path, score, d, j) for d, level in enumerate(levels) for j, (path, score) in
             enumerate(level)),
            key=lambda node: (-node[1], node[2], node[3]),
        )  # fmt: skip
        return [(path, score) for path, score, _, _ in nodes[: n * len(levels)]]
    if selection == "joint":
        order = sorted(range(len(leaves)), key=lambda j: (-leaves[j][1], j))
        return [leaves[j] for j in order[:n]]
    prob = {path: math.exp(score) for level in levels for path, score in level}
    covered: set[tuple[int, ...]] = set()
    picked: list[int] = []
    for _ in range(n):
        gains = [
            -1.0
            if j in picked
            else sum(prob[path[: d + 1]] for d in range(len(path)) if path[: d + 1] not in covered)
            for j, (path, _) in enumerate(leaves)
        ]
        j = max(range(len(leaves)), key=lambda j: (gains[j], -j))
        picked.append(j)
        covered.update(leaves[j][0][: d + 1] for d in range(len(leaves[j][0])))
    return [leaves[j] for j in picked]


def _check_against_reference(
    model: MLPSpeculator,
    reference: MLPSpeculator,
    states: torch.Tensor,
    tokens: torch.Tensor,
    top_k: tuple[int, ...],
    n: int,
    selection: str,
    vocab: list[int] | None,
    num_drafts: int | None = None,
) -> None:
    paths, scores = model.draft_candidates(states, tokens, top_k, n, selection, num_drafts)
    num = min(num_candidates(top_k, n, selection), num_drafts or 10**9)
    assert paths.shape == (states.shape[0], num, len(top_k)) and paths.dtype == np.int64
    assert scores.shape == (states.shape[0], num) and scores.dtype == np.float32
    for b in range(states.shape[0]):
        levels = _reference_tree(
            reference, states[b], int(tokens[b]), top_k, vocab, _int8_heads(model)
        )
        expected = _reference_candidates(levels, n, selection)[:num]
        padded = [path + (-1,) * (len(top_k) - len(path)) for path, _ in expected]
        assert [tuple(p) for p in paths[b].tolist()] == padded
        for got, (_, score) in zip(scores[b].tolist(), expected, strict=True):
            assert got == pytest.approx(score, abs=1e-5)


@pytest.mark.parametrize("selection", ["nodes", "joint", "coverage"])
@pytest.mark.parametrize("engine_linears", [False, True])
@pytest.mark.parametrize(
    ("tie", "scale", "restricted"),
    [(False, False, False), (False, True, True), (True, False, True), (True, True, False)],
)
def test_candidates_match_the_per_node_reference(
    selection: str, engine_linears: bool, tie: bool, scale: bool, restricted: bool
) -> None:
    reference, model, vocab = _reference_and_copy(tie, scale, restricted, seed=3)
    if engine_linears:
        use_engine_linears(model)
        assert all(isinstance(head, Int8Head) for head in model.head)
        reference = _as_drafted(reference, model, vocab)
    generator = torch.Generator().manual_seed(5)
    for batch in (1, 3):
        states = 2 * torch.randn(batch, EMB_DIM, generator=generator)
        tokens = torch.randint(0, VOCAB, (batch,), generator=generator)
        for top_k, n in (((5, 3, 2), 5), ((4, 2, 2), 16), ((2, 1, 3), 1)):
            _check_against_reference(
                model, reference, states, tokens, top_k, n, selection,
                None if vocab is None else vocab.tolist(),
            )  # fmt: skip


@pytest.mark.parametrize("engine_linears", [False, True])
def test_a_budget_of_drafts_keeps_the_first_picks_and_scores_fewer_nodes(
    engine_linears: bool,
) -> None:
    """Drafting "nodes" with `num_drafts` returns the whole tree's first picks (the
    reference's), for every budget, while its last head scores only the nodes that can lead to
    them."""
    reference = _speculator(seed=12)
    model = copy.deepcopy(reference)
    if engine_linears:
        use_engine_linears(model)
        reference = _as_drafted(reference, model)
    scored: list[int] = []
    last_head = model.head[-1]
    model.head[-1] = _Recorded(last_head, scored)
    generator = torch.Generator().manual_seed(13)
    for batch in (1, 3):
        states = 2 * torch.randn(batch, EMB_DIM, generator=generator)
        tokens = torch.randint(0, VOCAB, (batch,), generator=generator)
        for top_k, n in (((5, 3, 2), 5), ((4, 2, 2), 16), ((2, 3, 2), 3)):
            for num_drafts in range(1, num_candidates(top_k, n, "nodes") + 2):
                scored.clear()
                _check_against_reference(
                    model, reference, states, tokens, top_k, n, "nodes", None, num_drafts
                )
                # a node with a picked child ranks before the last pick, so at most
                # num_drafts - 1 nodes per request need their children scored
                assert sum(scored) <= batch * max(num_drafts - 1, 0)


class _Recorded(nn.Module):
    """A module that records the rows it is given."""

    def __init__(self, module: nn.Module, rows: list[int]) -> None:
        super().__init__()
        self.module = module
        self.rows = rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return cast(torch.Tensor, self.module(x))


@pytest.mark.parametrize("n_predict", [1, 2, 4])
def test_other_depths_match_the_per_node_reference(n_predict: int) -> None:
    model = _speculator(n_predict=n_predict, scale=True, seed=6)
    top_k = (3, 2, 2, 2)[:n_predict]
    states = 2 * torch.randn(2, EMB_DIM, generator=torch.Generator().manual_seed(7))
    tokens = torch.tensor([5, 99])
    for selection in ("nodes", "joint", "coverage"):
        for n in (1, math.prod(top_k)):
            _check_against_reference(model, model, states, tokens, top_k, n, selection, None)


def test_candidates_come_to_the_host_and_the_module_still_trains() -> None:
    model = _speculator(scale=True)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    states = torch.randn(2, EMB_DIM, generator=torch.Generator().manual_seed(8))
    paths, scores = model.draft_candidates(states, torch.tensor([1, 2]), (5, 3, 2), 5)
    assert isinstance(paths, np.ndarray) and isinstance(scores, np.ndarray)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    logits = model(states[:, None], torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]))  # [3, 2, 1, V]
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_non_finite_log_probabilities_still_draft_distinct_tokens() -> None:
    model = _speculator()
    with torch.no_grad():
        _param(model.head[1])[7, 0] = math.nan  # head 1's log-probabilities all nan
    states = torch.randn(1, EMB_DIM, generator=torch.Generator().manual_seed(10))
    paths, _ = model.draft_candidates(states, torch.tensor([3]), (2, 3, 2), 12)
    leaves = [tuple(p) for p in paths[0].tolist()]
    for first in {leaf[0] for leaf in leaves}:
        assert len({leaf[1] for leaf in leaves if leaf[0] == first}) == 3


def test_coverage_picks_match_the_reference() -> None:
    generator = torch.Generator().manual_seed(11)
    levels = []  # per depth: [B, F_d] summed log-probabilities
    scores = torch.zeros(3, 1)
    for k in (4, 3, 2):
        step = -3 * torch.rand(3, scores.shape[1], k, generator=generator)  # [B, F, k]
        scores = (scores[:, :, None] + step).flatten(1)
        levels.append(scores)
    picks = coverage_picks([level.exp().numpy() for level in levels], 7)
    assert picks.dtype == np.int64 and picks.shape == (3, 7)
    # Each leaf's path as its ancestors' indices, depth by depth: a node's key is its prefix.
    paths = [tuple(j // (24 // level.shape[1]) for level in levels) for j in range(24)]
    for b in range(3):
        tree = [[(p[: d + 1], float(levels[d][b, p[d]])) for p in paths] for d in range(3)]
        expected = _reference_candidates(tree, 7, "coverage")
        assert [paths.index(path) for path, _ in expected] == picks[b].tolist()
    underflow = [(level - 200 * (level < -4)).exp().numpy() for level in levels]  # some 0
    everything = coverage_picks(underflow, 24)  # gains all 0 before the last picks
    assert sorted(everything[0].tolist()) == list(range(24))


def test_the_proposer_drafts_the_candidates_as_trees() -> None:
    reference = _speculator(scale=True, seed=12)
    proposer = MLPProposer(copy.deepcopy(reference), (4, 2, 2), 5)
    reference = _as_drafted(reference, proposer.speculator)
    states = torch.randn(3, EMB_DIM, generator=torch.Generator().manual_seed(13))
    inputs = [
        ProposalInput(f"r{b}", [1, 2, 10 * b + 3], states[b], max_depth)
        for b, max_depth in enumerate((3, 2, 1))
    ]
    trees = proposer.propose(inputs)
    for p, tree in zip(inputs, trees, strict=True):
        levels = _reference_tree(
            reference, p.hidden_state, p.token_ids[-1], (4, 2, 2), None,
            _int8_heads(proposer.speculator),
        )  # fmt: skip
        expected = [path for path, _ in _reference_candidates(levels, 5, "nodes")]  # 15 nodes
        assert tree == DraftTree.from_paths(expected, p.max_depth)
        assert proposer.num_candidates == 15 and len(tree.leaves) == 15
        if p.max_depth == 3:  # each candidate adds one node: any k of them are a k-draft tree
            assert tree.leaves == tuple(range(1, 16))


@pytest.mark.parametrize(
    ("tie", "scale", "restricted"), [(False, False, False), (True, True, True), (False, True, True)]
)
def test_the_proposer_drafts_the_first_nodes_it_is_asked_for(
    tie: bool, scale: bool, restricted: bool, drafting_ops: str
) -> None:
    """With "nodes" selection (on a CPU with the fused kernels: `FusedNodeDrafting`, one C
    call) and `max_candidates`, each request's tree is the reference's first picks, cut to the
    request's depth."""
    reference, model, vocab = _reference_and_copy(tie, scale, restricted, seed=16)
    proposer = MLPProposer(model, (4, 2, 2), 5)
    assert (proposer.fused is not None) == (drafting_ops == "fused")
    reference = _as_drafted(reference, proposer.speculator, vocab)
    states = 2 * torch.randn(3, EMB_DIM, generator=torch.Generator().manual_seed(18))
    inputs = [
        ProposalInput(f"r{b}", [1, 2, 10 * b + 3], states[b], max_depth)
        for b, max_depth in enumerate((3, 3, 2))
    ]
    columns = None if vocab is None else vocab.tolist()
    for max_candidates in (1, 2, 5, 9, 15, 20):
        trees = proposer.propose(inputs, max_candidates)
        for p, tree in zip(inputs, trees, strict=True):
            levels = _reference_tree(
                reference, p.hidden_state, p.token_ids[-1], (4, 2, 2), columns,
                _int8_heads(proposer.speculator),
            )  # fmt: skip
            nodes = _reference_candidates(levels, 5, "nodes")[:max_candidates]
            assert tree == DraftTree.from_paths([path for path, _ in nodes], p.max_depth)


def test_fused_drafting_refuses_more_tokens_per_head_than_the_heads_score() -> None:
    _, model, _ = _reference_and_copy(tie=False, scale=False, restricted=True, seed=19)
    use_engine_linears(model)  # the heads score the 40 tokens of the draft vocabulary
    kernels, lib = load_cpu_kernels(), load_rows_gemm()
    assert kernels is not None and lib is not None
    fused = FusedNodeDrafting(model, kernels, lib)
    states = [torch.randn(EMB_DIM, generator=torch.Generator().manual_seed(20))]
    with pytest.raises(ValueError, match="at most 40 tokens per head"):
        fused.draft(states, [1], (41, 1, 1), 3, [3])
    (tree,) = fused.draft(states, [1], (40, 1, 1), 3, [3])
    assert tree.num_drafts == 3


def test_int8_heads_round_each_weight_and_input_row_to_its_scale() -> None:
    lib = load_rows_gemm()
    assert lib is not None, "rows_gemm.c must build on a machine with a C compiler"
    weight = torch.randn(100, INNER_DIM, generator=torch.Generator().manual_seed(14))  # [out, in]
    weight[3] = 0.0
    head = Int8Head(weight, lib)
    dequantized = head.dequantized()  # [out, in]
    assert dequantized.shape == weight.shape
    bound = weight.abs().amax(1, keepdim=True) / 254  # half a step of each token's scale
    assert ((dequantized - weight).abs() <= bound * (1 + 1e-6)).all()
    assert (dequantized[3] == 0).all()
    x = torch.randn(2, 3, INNER_DIM, generator=torch.Generator().manual_seed(15))
    y = head(x)  # [2, 3, out]
    assert y.shape == (2, 3, 100)
    rows = torch.stack([_as_int8_input(r) for r in x.double().reshape(6, INNER_DIM)])
    expected = (rows @ dequantized.double().T).view(2, 3, 100)
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)


def test_node_picks_put_every_node_after_its_ancestors() -> None:
    # depth 0: 2 nodes; depth 1: 2 children each; a child as likely as its parent (log-prob 0)
    # ties with it, and -inf paths come last, still after their ancestors
    scores = [
        np.array([[-0.5, -1.0]], dtype=np.float32),
        np.array([[-0.5, -np.inf, -1.2, -3.0]], dtype=np.float32),
    ]
    picks = node_picks(scores, 6)[0].tolist()
    assert picks == [0, 2, 1, 4, 5, 3]
    paths = tree_shape((2, 4)).node_paths
    for i, node in enumerate(picks):
        ancestors = [a for a in paths[node].tolist() if a >= 0][:-1]
        assert all(a in picks[:i] for a in ancestors)
