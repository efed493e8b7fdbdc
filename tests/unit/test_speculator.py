"""The MLP speculator's maths, candidate tree, draft trees and checkpoint loading.

Oracles: the speculator's formulas (fms-extras' MLPSpeculator, see
engine/spec_decode/mlp_speculator.py) written out per path in plain torch, the
published constants, and the tensors the checkpoint generator wrote.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.models.loader import CheckpointError
from engine.spec_decode.loader import load_speculator, write_draft_vocabulary
from engine.spec_decode.mlp_speculator import MLPSpeculator
from engine.spec_decode.speculator_config import DRAFT_VOCABULARY_FILE, MLPSpeculatorConfig
from engine.spec_decode.tree import DraftTree
from tests.reference import random_speculator
from tools.tiny_speculator import FORMATS, write_tiny_speculator


def _random_speculator(
    n_predict: int = 3, tie: bool = False, scale: bool = False, seed: int = 0
) -> MLPSpeculator:
    return random_speculator(50, n_predict, tie, scale, seed)


@torch.no_grad()
def _reference_path_logprobs(
    model: MLPSpeculator,
    state: torch.Tensor,
    token: int,
    path: list[int],
    vocab: list[int] | None = None,
) -> list[torch.Tensor]:
    """Per-head log-softmax along one path, straight from the stage recurrence with the
    beta/alpha weighted sum (the Feb-2024 form), not the module's scaled form; over `vocab`
    only (-inf elsewhere) when given."""
    cfg = model.config
    n, d = cfg.n_predict, cfg.inner_dim
    beta = 0.5 ** (0.5 / n)
    alpha = math.sqrt((1 - beta**2) * d / 2)
    s = state.double()
    if cfg.scale_input:
        s = s / torch.sqrt(s.pow(2).mean() + 1e-6) / math.sqrt(2)
    tokens = [token, *path]
    out = []
    for i in range(len(path)):
        u = model.proj[i].weight.double() @ s
        z = model.emb[i].weight.double()[tokens[i]]
        x = beta * u + alpha * z
        x = x / torch.sqrt(x.pow(2).mean() + 1e-6)
        x = model.ln[i].weight.double() * x + model.ln[i].bias.double()
        s = 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
        logits = model.head[i].weight.double() @ s
        if vocab is not None:
            outside = torch.ones_like(logits, dtype=torch.bool)
            outside[vocab] = False
            logits = logits.masked_fill(outside, -torch.inf)
        out.append(logits.log_softmax(-1))
    return out


def test_constants_match_the_published_values() -> None:
    config = MLPSpeculatorConfig(vocab_size=10, emb_dim=5120, inner_dim=4096, n_predict=3)
    assert config.top_k_tokens_per_head == (5, 3, 2)
    assert MLPSpeculator(config, device="meta").emb_scale == pytest.approx(23.0720, abs=1e-4)
    config = MLPSpeculatorConfig(vocab_size=10, emb_dim=4096, inner_dim=3072, n_predict=4)
    assert MLPSpeculator(config, device="meta").emb_scale == pytest.approx(17.0476, abs=1e-4)


def test_parameter_count_of_llama_13b_accelerator() -> None:
    config = MLPSpeculatorConfig(vocab_size=32000, emb_dim=5120, inner_dim=4096, n_predict=3)
    model = MLPSpeculator(config, device="meta")
    assert sum(p.numel() for p in model.parameters()) == 840_982_528


def test_tied_weights_share_as_specified() -> None:
    model = _random_speculator(n_predict=4, tie=True)
    assert all(model.emb[i] is model.emb[0] for i in range(4))
    assert all(model.head[i] is model.head[0] for i in range(4))
    assert all(model.ln[i] is model.ln[0] for i in range(4))
    assert model.proj[2] is model.proj[1] and model.proj[3] is model.proj[1]
    assert model.proj[1] is not model.proj[0]
    names = [n for n, _ in model.named_parameters()]
    unique = ["emb.0.weight", "proj.0.weight", "proj.1.weight", "head.0.weight", "ln.0.weight"]
    assert sorted(names) == sorted([*unique, "ln.0.bias"])


@pytest.mark.parametrize(("tie", "scale"), [(False, False), (True, True), (False, True)])
def test_candidates_are_the_best_joint_paths(tie: bool, scale: bool) -> None:
    model = _random_speculator(tie=tie, scale=scale)
    top_k = (4, 3, 2)
    states = torch.randn(2, 24, generator=torch.Generator().manual_seed(1))
    tokens = torch.tensor([3, 17])
    paths, scores = model.draft_candidates(states, tokens, top_k, 24)  # every leaf
    for b in range(2):
        # Expected: enumerate the tree with per-head top-k from the reference recurrence.
        leaves: dict[tuple[int, ...], float] = {}
        for ranks in itertools.product(*(range(k) for k in top_k)):
            path: list[int] = []
            score = 0.0
            for i, r in enumerate(ranks):
                logprobs = _reference_path_logprobs(model, states[b], int(tokens[b]), [*path, 0])
                order = logprobs[i].argsort(descending=True)
                path.append(int(order[r]))
                score += float(logprobs[i][order[r]])
            leaves[tuple(path)] = score
        got = {tuple(p): float(s) for p, s in zip(paths[b].tolist(), scores[b], strict=True)}
        assert got.keys() == leaves.keys()
        for path, score in got.items():
            assert score == pytest.approx(leaves[path], abs=1e-4)
        assert scores[b].tolist() == sorted(scores[b].tolist(), reverse=True)
        best, _ = model.draft_candidates(states[b : b + 1], tokens[b : b + 1], top_k, 5)
        assert best[0].tolist() == paths[b, :5].tolist()


def _reference_tree(
    model: MLPSpeculator,
    state: torch.Tensor,
    token: int,
    top_k: tuple[int, ...],
    vocab: list[int] | None = None,
) -> tuple[list[tuple[int, ...]], dict[tuple[int, ...], float]]:
    """Every leaf path of the top-k tree in mixed-radix order, and the probability of every
    path prefix (the product of its tokens' probabilities), from the reference recurrence
    (drafting from `vocab` only, when given)."""
    leaves: list[tuple[int, ...]] = []
    prefix_prob: dict[tuple[int, ...], float] = {}
    for ranks in itertools.product(*(range(k) for k in top_k)):
        path: list[int] = []
        score = 0.0
        for i, r in enumerate(ranks):
            logprobs = _reference_path_logprobs(model, state, token, [*path, 0], vocab)
            order = logprobs[i].argsort(descending=True)
            path.append(int(order[r]))
            score += float(logprobs[i][order[r]])
            prefix_prob[tuple(path)] = math.exp(score)
        leaves.append(tuple(path))
    return leaves, prefix_prob


@pytest.mark.parametrize("top_k", [(4, 3, 2), (5, 1, 1), (2, 2, 2)])
def test_coverage_candidates_add_the_most_expected_accepted_drafts(top_k: tuple[int, ...]) -> None:
    model = _random_speculator(scale=True)
    states = 3 * torch.randn(3, 24, generator=torch.Generator().manual_seed(4))
    tokens = torch.tensor([3, 17, 40])
    n = 5
    paths, scores = model.draft_candidates(states, tokens, top_k, n, selection="coverage")
    for b in range(3):
        leaves, prefix_prob = _reference_tree(model, states[b], int(tokens[b]), top_k)
        covered: set[tuple[int, ...]] = set()
        expected: list[tuple[int, ...]] = []
        for _ in range(n):
            gains = [
                -1.0
                if leaf in expected
                else sum(
                    prefix_prob[leaf[: d + 1]]
                    for d in range(len(leaf))
                    if leaf[: d + 1] not in covered
                )
                for leaf in leaves
            ]
            pick = leaves[max(range(len(leaves)), key=lambda j: (gains[j], -j))]
            expected.append(pick)
            covered.update(pick[: d + 1] for d in range(len(pick)))
        assert [tuple(p) for p in paths[b].tolist()] == expected
        for path, score in zip(expected, scores[b].tolist(), strict=True):
            assert math.exp(score) == pytest.approx(prefix_prob[path], rel=1e-4)
    with pytest.raises(ValueError, match="selection"):
        model.draft_candidates(states, tokens, top_k, n, selection="best")


@pytest.mark.parametrize("tie", [False, True])
def test_a_draft_vocabulary_drafts_the_best_paths_within_it(tie: bool) -> None:
    model = _random_speculator(tie=tie, scale=True)
    vocab = torch.randperm(50, generator=torch.Generator().manual_seed(2))[:17]
    restricted = copy.deepcopy(model)
    restricted.restrict_vocabulary(vocab)
    assert restricted.head[0].weight.shape == (17, 16)
    assert (restricted.num_draft_tokens, model.num_draft_tokens) == (17, 50)
    assert (restricted.head[2] is restricted.head[0]) == tie
    top_k = (4, 3, 2)
    states = 3 * torch.randn(2, 24, generator=torch.Generator().manual_seed(5))
    tokens = torch.tensor([3, 17])
    paths, scores = restricted.draft_candidates(states, tokens, top_k, 24)  # every leaf
    for b in range(2):
        leaves, prefix_prob = _reference_tree(
            model, states[b], int(tokens[b]), top_k, vocab.tolist()
        )
        got = {tuple(p): s for p, s in zip(paths[b].tolist(), scores[b].tolist(), strict=True)}
        assert got.keys() == set(leaves)
        for path, score in got.items():
            assert set(path) <= set(vocab.tolist())
            assert math.exp(score) == pytest.approx(prefix_prob[path], rel=1e-4)
    with pytest.raises(ValueError, match="already restricted"):
        restricted.restrict_vocabulary(vocab)
    for bad in (torch.tensor([1, 50]), torch.tensor([4, 4]), torch.tensor([], dtype=torch.int64)):
        with pytest.raises(ValueError, match="draft vocabulary"):
            copy.deepcopy(model).restrict_vocabulary(bad)


def test_teacher_forced_forward_matches_the_recurrence() -> None:
    model = _random_speculator(scale=True)
    state = torch.randn(1, 4, 24, generator=torch.Generator().manual_seed(2))
    token_ids = torch.randint(0, 50, (1, 7), generator=torch.Generator().manual_seed(3))
    logits = model(state, token_ids)  # [3, 1, 4, 50]
    for t in range(4):
        path = token_ids[0, t + 1 : t + 4].tolist()
        expected = _reference_path_logprobs(model, state[0, t], int(token_ids[0, t]), path)
        for i in range(3):
            got = logits[i, 0, t].double().log_softmax(-1)
            torch.testing.assert_close(got, expected[i], atol=1e-5, rtol=1e-5)
    assert F.gelu(torch.tensor(1.0)).item() == pytest.approx(0.841345, abs=1e-6)  # exact GELU


def test_tree_shape_is_validated() -> None:
    with pytest.raises(ValueError, match="n_predict"):
        MLPSpeculatorConfig(vocab_size=5, emb_dim=4, n_predict=3, top_k_tokens_per_head=(5, 3))
    with pytest.raises(ValueError, match="n_candidates"):
        MLPSpeculatorConfig(
            vocab_size=5, emb_dim=4, n_predict=2, top_k_tokens_per_head=(2, 2), n_candidates=5
        )


def test_draft_tree_merges_shared_prefixes_in_candidate_order() -> None:
    tree = DraftTree.from_paths([[1, 2, 3], [1, 2, 4], [1, 5, 6]])
    assert tree.token_ids == (1, 2, 3, 4, 5, 6)
    assert tree.parents == (0, 1, 2, 2, 1, 5)
    assert tree.depths == (0, 1, 2, 3, 3, 2, 3)
    assert tree.depth == 3
    assert tree.child(2, 4) == 4 and tree.child(2, 9) is None
    assert tree.path(6) == [1, 5, 6]
    assert DraftTree.from_paths([[1, 2, 3], [7, 8, 9]], max_depth=2).token_ids == (1, 2, 7, 8)
    assert tree.leaves == (3, 4, 6)
    assert tree.truncate(3) == DraftTree((1, 2, 3), (0, 1, 2), (3,))
    assert tree.first_candidates(2) == DraftTree((1, 2, 3, 4), (0, 1, 2, 2), (3, 4))
    assert tree.match_lengths([1, 2, 4, 9]) == [2, 3, 1]
    assert tree.match_lengths([7]) == [0, 0, 0]


def test_draft_tree_mask_is_ancestor_or_self() -> None:
    tree = DraftTree.from_paths([[1, 2, 3], [1, 2, 4], [1, 5, 6], [7]])
    mask = tree.attention_mask()
    n = tree.num_drafts + 1
    for i in range(n):
        ancestors = {0, *tree.path(i)}
        assert {j for j in range(n) if mask[i, j]} == ancestors
    with pytest.raises(ValueError, match="precede"):
        DraftTree((1, 2), (0, 2))
    with pytest.raises(ValueError, match="sibling"):
        DraftTree((1, 1), (0, 0))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tie", [False, True])
def test_loader_reads_every_format(tmp_path: Path, tiny_path: Path, fmt: str, tie: bool) -> None:
    path = write_tiny_speculator(tmp_path / "spec", tiny_path, tie_weights=tie, fmt=fmt, seed=5)
    config = json.loads((tiny_path / "config.json").read_text())
    model = load_speculator(
        path,
        hidden_size=config["hidden_size"],
        vocab_size=config["vocab_size"],
        dtype=torch.float32,
        device="cpu",
        n_predict=3 if fmt == "torch-file" and tie else None,
    )
    reference = load_speculator(
        write_tiny_speculator(tmp_path / "ref", tiny_path, tie_weights=tie, seed=5),
        hidden_size=config["hidden_size"],
        vocab_size=config["vocab_size"],
        dtype=torch.float32,
        device="cpu",
    )
    assert model.config.n_predict == 3 and model.config.tie_weights == tie
    for (name, p), (_, q) in zip(
        model.state_dict().items(), reference.state_dict().items(), strict=True
    ):
        assert torch.equal(p, q), name


def test_loader_accepts_duplicated_tied_tensors_without_prefix(
    tmp_path: Path, tiny_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    folder = write_tiny_speculator(tmp_path / "spec", tiny_path, tie_weights=True)
    state = load_file(str(folder / "model.safetensors"))
    full = {k.removeprefix("speculator."): v for k, v in state.items()}
    for i in (1, 2):
        full[f"emb.{i}.weight"] = full["emb.0.weight"].clone()
        full[f"head.{i}.weight"] = full["head.0.weight"].clone()
    full["proj.2.weight"] = full["proj.1.weight"].clone()
    save_file(full, str(folder / "model.safetensors"))
    cfg = json.loads((tiny_path / "config.json").read_text())
    model = load_speculator(
        folder, hidden_size=cfg["hidden_size"], vocab_size=cfg["vocab_size"],
        dtype=torch.float32, device="cpu",
    )  # fmt: skip
    assert torch.equal(model.emb[2].weight, state["speculator.emb.0.weight"])
    full["head.2.weight"] = full["head.2.weight"] + 1
    save_file(full, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"tied tensor 'head\.2\.weight' differs"):
        load_speculator(
            folder, hidden_size=cfg["hidden_size"], vocab_size=cfg["vocab_size"],
            dtype=torch.float32, device="cpu",
        )  # fmt: skip


def test_loader_refuses_mismatches_and_broken_checkpoints(tmp_path: Path, tiny_path: Path) -> None:
    cfg = json.loads((tiny_path / "config.json").read_text())
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]

    def load(path: Path) -> MLPSpeculator:
        return load_speculator(
            path, hidden_size=hidden, vocab_size=vocab, dtype=torch.float32, device="cpu"
        )

    wide = write_tiny_speculator(tmp_path / "wide", tiny_path, emb_dim=hidden + 8)
    with pytest.raises(CheckpointError, match=f"emb_dim {hidden + 8} .* hidden_size {hidden}"):
        load(wide)
    small = write_tiny_speculator(tmp_path / "small", tiny_path, vocab_size=vocab - 1)
    with pytest.raises(CheckpointError, match=f"vocab_size {vocab - 1} .* vocab_size {vocab}"):
        load(small)
    with pytest.raises(CheckpointError, match="does not exist"):
        load(tmp_path / "nowhere")
    from safetensors.torch import load_file, save_file

    folder = write_tiny_speculator(tmp_path / "broken", tiny_path)
    state = load_file(str(folder / "model.safetensors"))
    del state["speculator.head.1.weight"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'head\.1\.weight'"):
        load(folder)
    state["speculator.extra.weight"] = torch.zeros(2)
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'speculator\.extra\.weight'"):
        load(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="model_type is 'llama'"):
        load(folder)
    drafts = write_tiny_speculator(tmp_path / "drafts", tiny_path)
    for text, error in (
        ('{"token_ids": [1, 2, 2]}', "repeated"),
        (f'{{"token_ids": [0, {vocab}]}}', f"below {vocab}"),
        ('{"token_ids": "all"}', "list of integers"),
        ("[1, 2", "unreadable"),
    ):
        (drafts / DRAFT_VOCABULARY_FILE).write_text(text)
        with pytest.raises(CheckpointError, match=f"{DRAFT_VOCABULARY_FILE}: .*{error}"):
            load(drafts)


def test_loader_restricts_drafting_to_the_draft_vocabulary(tmp_path: Path, tiny_path: Path) -> None:
    cfg = json.loads((tiny_path / "config.json").read_text())
    folder = write_tiny_speculator(tmp_path / "spec", tiny_path)
    ids = torch.tensor([9, 2, 40, 7, 100, 31])
    write_draft_vocabulary(folder, ids)
    kwargs = dict(hidden_size=cfg["hidden_size"], vocab_size=cfg["vocab_size"])
    full = load_speculator(
        folder, dtype=torch.float32, device="cpu", draft_vocabulary=False, **kwargs
    )
    restricted = load_speculator(folder, dtype=torch.float32, device="cpu", **kwargs)
    assert full.draft_vocabulary is None
    assert restricted.draft_vocabulary is not None
    assert restricted.draft_vocabulary.tolist() == ids.tolist()
    for i in range(full.config.n_predict):
        assert torch.equal(restricted.head[i].weight, full.head[i].weight[ids])
