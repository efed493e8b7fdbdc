"""The sampler's C passes (`engine/kernels/selection.py`) against the ATen ops they replace:
the same values bit for bit where the maths is one IEEE operation per element, and float64
sums within the bound of a different order."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import selection
from engine.kernels.cpu import load_cpu_kernels


@pytest.fixture(autouse=True)
def _built() -> None:
    assert load_cpu_kernels() is not None, "the C kernels must build on a machine with a C compiler"


def rows_of(kind: str, num_rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Scores of one shape: "flat" (random), "peaked" (a few clear leaders), "ties" (few
    distinct values), "masked" (mostly -inf, fewer finite values than some k)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, vocab, generator=g) * 3
    if kind == "peaked":
        x[:, torch.randint(0, vocab, (5,), generator=g)] += 25
    elif kind == "ties":
        x = torch.randint(0, 4, (num_rows, vocab), generator=g).float()
    elif kind == "masked":
        x[:, 40:] = float("-inf")
    return x


@pytest.mark.parametrize("kind", ["flat", "peaked", "ties", "masked"])
@pytest.mark.parametrize(
    ("vocab", "k"), [(49152, 58), (49152, 256), (1000, 1), (300, 300), (97, 7)]
)
def test_top_candidates_are_the_best_sorted_with_ties_by_id(kind: str, vocab: int, k: int) -> None:
    wide = rows_of(kind, 5, vocab + 3, seed=vocab + k)
    scores = wide[:, :vocab]  # a row stride other than the width
    found = selection.top_candidates(scores, k)
    assert found is not None
    values, ids = found
    # oracle: a stable sort descending keeps ties in id order
    expected_values, expected_ids = scores.sort(dim=-1, descending=True, stable=True)
    assert torch.equal(values, expected_values[:, :k])
    assert torch.equal(ids, expected_ids[:, :k])


def test_top_candidates_of_a_row_with_nan_returns_without_harm() -> None:
    scores = rows_of("flat", 3, 4096, seed=1)
    scores[1, ::7] = float("nan")
    found = selection.top_candidates(scores, 64)
    assert found is not None
    values, ids = found
    assert torch.equal(
        values[[0, 2]], scores[[0, 2]].sort(dim=-1, descending=True, stable=True)[0][:, :64]
    )
    assert bool(((ids >= 0) & (ids < 4096)).all())


@pytest.mark.parametrize("with_rows", [False, True])
def test_divide_rows_is_torch_division(with_rows: bool) -> None:
    x = rows_of("flat", 6, 49152 + 5, seed=2)[:, :49152]
    x[0, :10] = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-38, 3e38,
                              -3e38, 1e-45, 7.0])  # fmt: skip
    rows = torch.tensor([4, 0, 4, 2]) if with_rows else None
    divisors = torch.tensor([0.7, 1.0, 0.33, 1e-3, 2.5, 1.3][: 4 if with_rows else 6])
    got = selection.divide_rows(x, rows, divisors)
    expected = (x if rows is None else x[rows]) / divisors[:, None]
    assert got is not None
    assert torch.equal(got.nan_to_num(nan=123.0), expected.nan_to_num(nan=123.0))


@pytest.mark.parametrize("kind", ["flat", "peaked", "masked"])
def test_float64_sums_are_within_the_bound_of_any_order(kind: str) -> None:
    scores = rows_of(kind, 4, 49152, seed=3)
    shifted = scores - scores.amax(-1, keepdim=True)
    e = shifted.exp()
    bound = 2.0 * 49152 * 2.0**-53  # relative: two orders of summing these terms differ by less
    total = selection.row_sums_double(e)
    assert total is not None
    expected = e.double().sum(-1, keepdim=True)
    assert bool(((total - expected).abs() <= bound * expected.abs()).all())
    plogp = selection.plogp_sums_double(shifted, e, total.float())
    assert plogp is not None
    t = total.float()
    probs, logp = e / t, shifted - t.log()
    terms = torch.where(probs > 0, probs * logp, 0.0)  # the float32 terms torch computes
    expected = terms.double().sum(-1, keepdim=True)
    assert bool(((plogp - expected).abs() <= bound * expected.abs()).all())


@pytest.mark.parametrize("kind", ["flat", "peaked", "masked"])
def test_columns_at_least_are_nonzero_of_the_comparison(kind: str) -> None:
    scores = rows_of(kind, 4, 5000 + 3, seed=4)[:, :5000]
    thresholds = scores.amax(-1) - torch.tensor([1.0, 3.0, 6.0, float("inf")])
    expected = (scores >= thresholds[:, None]).nonzero(as_tuple=True)
    found = selection.columns_at_least(scores, thresholds, scores.numel())
    assert found is not None
    assert torch.equal(found[0], expected[0]) and torch.equal(found[1], expected[1])
    count = expected[0].numel()
    assert selection.columns_at_least(scores, thresholds, count) is not None
    assert selection.columns_at_least(scores, thresholds, count - 1) is None
