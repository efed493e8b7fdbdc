"""The int8 screen of a float32 LM head (engine/layers/head_screen.py) against float64 products
of the float weights: its proven bound holds, its rows' argmax is the exact argmax (near-ties of
float32 rounding apart), the exact candidates it keeps are the float logits, and it declines
where it cannot prove its answer. Then the engine with the screen against transformers, and the
rows the engine must not screen (sampling details, EOS masked, observers).
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cpu import load_cpu_kernels
from engine.kernels.quant_rows import kernel_isa
from engine.layers import head_screen
from engine.layers.head_screen import MAX_CANDIDATES, MAX_NEAR, MAX_ROWS, HeadScreen
from engine.layers.linear import Linear
from engine.llm import LLM
from engine.paths import default_model_path, model_path
from tests.reference import chat_prompt_ids, compare_greedy, hf_greedy, require_model

pytestmark = pytest.mark.skipif(
    load_cpu_kernels() is None or kernel_isa() not in ("avx512-vnni", "avx2"),
    reason="needs the C kernels with int8 products",
)
NEAR_TIE = 1e-4


def _head(weight: torch.Tensor) -> Linear:
    head = Linear(weight.shape[1], weight.shape[0], dtype=torch.float32, device="cpu")
    head.load_rows(0, weight)
    return head


def _screen(weight: torch.Tensor) -> HeadScreen:
    screen = HeadScreen.build(_head(weight), load_cpu_kernels())
    assert screen is not None
    return screen


def _inputs(k: int, rows: int, seed: int) -> torch.Tensor:
    """Hidden-state-like rows: mostly small entries, a few outliers in some groups."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    outliers = torch.randint(0, k, (rows, 3), generator=g)
    x.scatter_(1, outliers, 40 * torch.randn(rows, 3, generator=g))
    return x


def _weight(vocab: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = 0.05 * torch.randn(vocab, k, generator=g)
    w[:, :8] *= 6  # feature columns with large weights, as embeddings have
    return w


def _assert_exact_argmax(screened: torch.Tensor, exact: torch.Tensor) -> None:
    """Each screened row's argmax is the float64 argmax, or within NEAR_TIE of it."""
    for r in range(exact.shape[0]):
        ours, best = int(screened[r].argmax()), int(exact[r].argmax())
        if ours != best:
            gap = (exact[r, best] - exact[r, ours]).item()
            assert gap < NEAR_TIE, f"row {r}: {ours} instead of {best}, gap {gap:.3e}"


@pytest.mark.parametrize("seed", range(6))
def test_screened_rows_hold_the_exact_argmax_and_logits(seed: int) -> None:
    vocab, k = 3000 + 37 * seed, 192
    weight = _weight(vocab, k, seed)
    screen = _screen(weight)
    exact = _inputs(k, 40, seed).double() @ weight.double().T  # [40, V]: the oracle
    for start in range(0, 40, MAX_ROWS):
        x = _inputs(k, 40, seed)[start : start + MAX_ROWS]
        out = screen.logits(x)
        assert out is not None
        rows = exact[start : start + MAX_ROWS]
        _assert_exact_argmax(out, rows)
        kept = out.isfinite()
        assert (out[~kept] == float("-inf")).all()
        # the kept columns hold the float logits, and every column that may be the maximum
        # (within float32 rounding of it) is kept
        assert torch.allclose(out[kept].double(), rows[kept], rtol=0, atol=1e-3)
        close = rows >= rows.amax(dim=1, keepdim=True) - 1e-3
        assert kept[close].all()


def test_the_bound_holds_for_every_column() -> None:
    """|exact - int8 product| is within the bound the kernel uses, for every column: checked
    by asking for the columns with a lowered maximum (a huge bound holds everything)."""
    vocab, k = 2048, 128
    weight = _weight(vocab, k, 7)
    screen = _screen(weight)
    x = _inputs(k, 2, 7)
    approx = screen.product(x).double()
    exact = x.double() @ weight.double().T
    group = screen.group
    half = x.double().view(2, -1, group).abs().amax(dim=2) / 254.0  # [2, groups]
    basis = screen.basis.double()  # [groups + 2, V]
    bound = half @ basis[:-2] + x.double().norm(dim=1, keepdim=True) * basis[-2]
    assert ((exact - approx).abs() <= bound).all()


@pytest.mark.parametrize("error", ["activations", "weights"])
def test_an_error_near_its_bound_keeps_the_true_argmax(error: str) -> None:
    """Column A is the exact argmax, but the int8 product underestimates it by nearly its
    bound (the rounding errors of the activations', or of the weights', entries all aligned),
    so that column B, exact in int8, ranks above it there: the screen keeps A and picks it."""
    k, vocab = 128, 512
    step = 40.0 / 127  # activation group 0's step: its largest entry is 40
    x = torch.zeros(1, k)
    x[0, 0] = 40.0
    weight = 1e-3 * torch.randn(vocab, k, generator=torch.Generator().manual_seed(0))
    a, b = 10, 20
    weight[a] = 0.0
    if error == "activations":  # x's entries half a step off the int8 grid, A's weights exact
        x[0, 1:64] = (torch.arange(63) % 7 + 1 + 0.49) * step
        weight[a, 1:64] = 0.1
    else:  # x exact on the grid, A's weights there just under half a step (1 / 127): int8 0
        x[0, 1:64] = 40.0
        weight[a, 64] = 1.0
        weight[a, 1:64] = 0.49 / 127
    exact_a = float(x[0].double() @ weight[a].double())
    weight[b] = 0.0
    weight[b, 0] = (exact_a - 0.3) / 40.0  # B: second by 0.3 exactly, and exact in int8
    screen = _screen(weight)
    approx = screen.product(x)[0]
    assert approx[b] > approx[a]  # the product alone would pick B
    out = screen.logits(x)
    assert out is not None
    assert int(out[0].argmax()) == a


def test_near_ties_keep_both_columns() -> None:
    vocab, k = 1024, 128
    weight = _weight(vocab, k, 3)
    x = _inputs(k, 1, 3)
    best = int((x @ weight.T).argmax())
    twin = (best + 1) % vocab
    weight[twin] = weight[best]
    weight[twin, 0] += 1e-6 / max(abs(x[0, 0].item()), 1e-3)  # a tie within float32 rounding
    out = _screen(weight).logits(x)
    assert out is not None
    assert out[0, best].isfinite() and out[0, twin].isfinite()
    _assert_exact_argmax(out, x.double() @ weight.double().T)


@pytest.mark.parametrize("seed", range(3))
def test_maskable_columns_are_exact_and_masking_them_keeps_the_exact_argmax(seed: int) -> None:
    """Each row's exact argmax (and column 5) are passed as maskable: they come back exact, and
    with them masked each row's argmax is the exact argmax of the other columns, although the
    masked maximum's lower bound lies above those columns' upper bounds."""
    vocab, k = 2500, 192
    weight = _weight(vocab, k, seed)
    x = _inputs(k, MAX_ROWS, seed)
    exact = x.double() @ weight.double().T  # [M, V]: the oracle
    maskable = sorted({*exact.argmax(dim=1).tolist(), 5})
    out = _screen(weight).logits(x, maskable)
    assert out is not None
    assert torch.allclose(out[:, maskable].double(), exact[:, maskable], rtol=0, atol=1e-3)
    _assert_exact_argmax(out, exact)
    out[:, maskable] = float("-inf")
    exact[:, maskable] = float("-inf")
    _assert_exact_argmax(out, exact)


def test_declines_where_it_cannot_prove() -> None:
    vocab, k = 1024, 128
    weight = _weight(vocab, k, 1)
    head = _head(weight)
    screen = HeadScreen.build(head, load_cpu_kernels())
    assert screen is not None
    x = _inputs(k, MAX_ROWS + 1, 1)
    assert screen.logits(x) is None  # more rows than it takes
    bad = x[:1].clone()
    bad[0, 5] = float("nan")
    assert screen.logits(bad) is None
    plain = screen.logits(x[:1])
    assert plain is not None
    assert torch.equal(screen.logits(x[:1], [-1, vocab]), plain)  # ids that are no columns
    for vocab_size in (MAX_CANDIDATES + 8, MAX_NEAR + 8):
        flat = _screen(torch.ones(vocab_size, k) * 0.01)
        assert flat.logits(x[:1]) is None  # every column a candidate: too many
    head.load_rows(0, weight[:1] * 2)  # the weights changed since the build
    assert screen.logits(x[:1]) is None
    inf_weight = weight.clone()
    inf_weight[3, 3] = float("inf")
    assert HeadScreen.build(_head(inf_weight), load_cpu_kernels()) is None


def _screened_llm(path: str, **kwargs: object) -> LLM:
    llm = LLM(path, **kwargs)  # type: ignore[arg-type]
    assert llm.runner.model.screen is not None
    return llm


@pytest.mark.parametrize("name", ["default", "tiny-llama-gqa-tied", "tiny-llama-mha-untied"])
def test_engine_greedy_with_the_screen_matches_transformers(name: str) -> None:
    path = require_model(default_model_path() if name == "default" else model_path(name))
    with _screened_llm(str(path)) as llm:
        screen = llm.runner.model.screen
        assert screen is not None
        for prompt in chat_prompt_ids(path)[:3]:
            before = screen.screened_rows
            ours = llm.generate([list(prompt)], 24)[0].token_ids
            assert screen.screened_rows > before  # batch 1 of plain greedy: screened
            compare_greedy(ours, hf_greedy(path, prompt, 24))


def test_rows_read_for_more_than_the_argmax_are_not_screened() -> None:
    path = require_model(model_path("tiny-llama-gqa-tied"))
    prompt = list(chat_prompt_ids(path)[0])
    with _screened_llm(str(path)) as llm:
        screen = llm.runner.model.screen
        assert screen is not None
        plain = llm.generate([prompt], 8)[0].token_ids
        for kwargs in ({"logprobs": True}, {"repetition_penalty": 1.2}):
            before = screen.screened_rows
            llm.generate([prompt], 8, **kwargs)
            assert screen.screened_rows == before, kwargs
        before = screen.screened_rows
        observed = llm.generate([prompt], 8, return_logits=True)[0]
        assert screen.screened_rows == before  # observers read whole rows
        assert observed.token_ids == plain


def test_rows_with_eos_masked_are_screened_and_match_transformers() -> None:
    """A prompt the default model answers in fewer tokens than `min_new_tokens`: EOS is masked
    where it would be the argmax, and the screened rows still give transformers' tokens."""
    path = require_model(default_model_path())
    prompt = chat_prompt_ids(path)[16]
    with _screened_llm(str(path)) as llm:
        screen = llm.runner.model.screen
        assert screen is not None
        natural = llm.generate([list(prompt)], 24)[0].token_ids
        assert len(natural) < 16  # ends with EOS: the case this test is about
        before = screen.screened_rows
        ours = llm.generate([list(prompt)], 24, min_new_tokens=16)[0].token_ids
        assert screen.screened_rows > before
        assert len(ours) >= 16
        compare_greedy(ours, hf_greedy(path, prompt, 24, min_new_tokens=16))


def test_screen_is_built_only_for_a_float32_cpu_head_with_kernels() -> None:
    path = str(require_model(model_path("tiny-llama-gqa-tied")))
    with LLM(path, cpu_kernels=False) as llm:
        assert llm.runner.model.screen is None
    assert head_screen.HeadScreen.build(_head(torch.zeros(64, 64)), None) is None
