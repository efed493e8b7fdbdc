"""The batched sampler against the per-row oracle (`tests/sampling_oracle.py`): every TGIS rule,
alone and combined, mixed in one batch with greedy rows and the rows of a draft tree, gives the
same tokens, logprobs, ranks, top tokens and errors."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from engine.sampling.params import SamplingParams
from engine.sampling.sampler import sample_with_details
from tests.sampling_oracle import choices_row_by_row

VOCAB = 500
EOS = frozenset({2, 7})

_SAMPLED = [
    {"temperature": 0.7},
    {"temperature": 1.3, "top_k": 5},
    {"temperature": 1.0, "top_k": 1},
    {"temperature": 0.9, "top_p": 0.8},
    {"temperature": 1.2, "top_p": 0.3},
    {"temperature": 1.0, "typical_p": 0.6},
    {"temperature": 0.8, "repetition_penalty": 1.4},
    {"temperature": 0.8, "repetition_penalty": 0.7},
    {"temperature": 1.0, "top_k": 40, "top_p": 0.9},
    {"temperature": 0.6, "top_k": 30, "top_p": 0.95, "typical_p": 0.8},
    {"temperature": 1.1, "top_p": 0.9, "typical_p": 0.9, "repetition_penalty": 1.2},
    {"temperature": 0.7, "top_k": 50, "typical_p": 0.5, "repetition_penalty": 1.3},
    {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "typical_p": 1.0},  # rules off
    {"temperature": 1.0, "top_k": VOCAB},  # top-k at the vocabulary: off
]
_GREEDY = [
    {},
    {"repetition_penalty": 1.5},
    {"logprobs": True, "top_n_tokens": 3},
    {"repetition_penalty": 0.8, "logprobs": True, "top_n_tokens": 2},
]


def _batch(seed: int) -> tuple[list, ...]:  # type: ignore[type-arg]
    """Rows of every kind, each also with min_new_tokens, a length penalty, logprobs + top-n;
    the last rows are a draft tree's nodes: one seeded request at several positions, each
    row's past extended by the drafts on its node's path."""
    g = torch.Generator().manual_seed(seed)
    rows: list[tuple[SamplingParams, int, int, list[int], int]] = []
    extras = [
        {},
        {"min_new_tokens": 4},
        {"length_penalty": (1, 1.6)},
        {"logprobs": True, "top_n_tokens": 4},
    ]
    for n, (kind, extra) in enumerate(itertools.product(_SAMPLED + _GREEDY, extras)):
        params = SamplingParams(max_new_tokens=32, seed=1000 + n, **{**kind, **extra})
        past = torch.randint(0, VOCAB, (int(torch.randint(0, 20, (1,), generator=g)),),
                             generator=g).tolist()  # fmt: skip
        rows.append((params, 1000 + n, 30 + n, past, n % 6))
    tree = SamplingParams(max_new_tokens=32, seed=99, temperature=0.9, top_k=20, top_p=0.9,
                          repetition_penalty=1.2, logprobs=True, top_n_tokens=2)  # fmt: skip
    prompt = [5, 9, 11, 400]
    for path in ([], [17], [17, 23], [31], [31, 44]):
        rows.append((tree, 99, 50 + len(path), prompt + path, 3 + len(path)))
    logits = torch.randn(len(rows), VOCAB, generator=g) * 3
    logits[:, 7] = logits.max(-1).values  # an EOS at the top: the EOS rules decide
    for row in (3, 16, 32, 33, 34, 35):  # ties of ten at the top (rows 32-35: top-k and top-p)
        logits[row, 100:110] = logits[row].max() + 1
    logits[5, 11] = float("nan")
    logits[6, 12] = float("inf")
    return rows, logits  # type: ignore[return-value]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_rules_equal_the_per_row_rules(seed: int) -> None:
    rows, logits = _batch(seed)
    params, seeds, positions, past, generated = (list(c) for c in zip(*rows, strict=True))
    eos = [EOS] * len(rows)
    batched = sample_with_details(logits, params, seeds, positions, past, generated, eos)
    oracle = choices_row_by_row(logits, params, seeds, positions, past, generated, eos)
    assert batched.errors == oracle.errors
    assert batched.token_ids == oracle.token_ids
    assert batched.details == oracle.details
    assert sum(e is not None for e in batched.errors) == 2
    assert sum(d is not None for d in batched.details) > 25


def test_groups_on_a_second_thread_choose_as_the_per_row_rules(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With two threads allowed, a CPU batch gives groups of rows to a second thread; the
    choices are the per-row oracle's."""
    import engine.sampling.batch_choice as batch_choice

    pool, given = batch_choice._pool(), []

    class Counted:
        def submit(self, *args):  # type: ignore[no-untyped-def]
            given.append(args)
            return pool.submit(*args)

    monkeypatch.setattr(batch_choice, "_pool", Counted)
    rows, logits = _batch(1)
    params, seeds, positions, past, generated = (list(c) for c in zip(*rows, strict=True))
    eos = [EOS] * len(rows)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        batched = sample_with_details(logits, params, seeds, positions, past, generated, eos)
    finally:
        torch.set_num_threads(threads)
    assert given
    assert batched == choices_row_by_row(logits, params, seeds, positions, past, generated, eos)


def test_top_k_ties_beyond_the_candidates() -> None:
    """Twenty tokens tie at the 3rd score: all of them are kept, as the per-row top-k keeps
    them (the row is chosen again over the whole vocabulary)."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3))
    logits[:, 200:220] = 8.0
    logits[:, 50] = 9.0
    params = [SamplingParams(temperature=1.0, top_k=3, seed=s, logprobs=True, top_n_tokens=30)
              for s in range(3)]  # fmt: skip
    args = (logits, params, [0, 1, 2], [4, 5, 6], [[], [], []], [0, 0, 0], [EOS] * 3)
    batched = sample_with_details(*args)
    assert batched == choices_row_by_row(*args)
    assert all(len(d.top_token_ids) == 21 for d in batched.details if d is not None)


def test_unfiltered_rows_without_details() -> None:
    """Sampled rows that filter nothing and ask for no details (drawn in token id order) with
    plain greedy rows and EOS rules."""
    rows, logits = _batch(4)
    params = [
        SamplingParams(temperature=0.5 + 0.1 * (i % 7), seed=i, min_new_tokens=2 * (i % 3),
                       repetition_penalty=1.0 + 0.1 * (i % 4)) if i % 5 else SamplingParams()
        for i in range(len(rows))
    ]  # fmt: skip
    n = len(rows)
    past = [r[3] for r in rows]
    args = (logits, params, list(range(n)), list(range(40, 40 + n)), past, [1] * n, [EOS] * n)
    batched = sample_with_details(*args)
    assert batched == choices_row_by_row(*args)
    assert len(set(batched.token_ids)) > n // 2


def test_nucleus_candidates_and_their_overflow() -> None:
    """Top-p without top-k over a vocabulary wider than the nucleus candidates: peaked rows
    (the nucleus among them) and flat rows (a nucleus beyond them, chosen again over the whole
    vocabulary), with typical-p, penalties and details."""
    vocab = 5000
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(8, vocab, generator=g) * 4  # peaked
    logits[4:] = torch.randn(4, vocab, generator=g) * 0.05  # flat: nuclei of thousands
    params = [
        SamplingParams(temperature=0.8 + 0.1 * i, top_p=0.5 + 0.06 * i, seed=i,
                       typical_p=0.9 if i % 2 else 1.0, repetition_penalty=1.2 if i % 3 else 1.0,
                       logprobs=i % 4 == 0, top_n_tokens=3)
        for i in range(8)
    ]  # fmt: skip
    past = [list(range(i, 40 * i, 7)) for i in range(8)]
    args = (logits, params, list(range(8)), list(range(8)), past, [0] * 8, [EOS] * 8)
    batched = sample_with_details(*args)
    assert batched == choices_row_by_row(*args)
    assert -1 not in batched.token_ids


def _wide_batch(vocab: int, num_rows: int, seed: int) -> torch.Tensor:
    """Rows over a wide vocabulary, peaked (few tokens hold the mass) and flat (thousands do)
    in turns, one with a tie of a hundred tokens at the 481st-580th scores."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=g)
    logits[::2] *= 4
    logits[1::2] *= 0.3
    logits[2, :480] = 5.0
    logits[2, 480:580] = 4.9
    logits[2, 580:] = -10.0
    return logits


def test_wide_vocabulary_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    """More rows than a CPU chooses at a time, over a vocabulary wider than the candidates:
    top-p, typical-p alone and with top-p, rules off, each with and without penalties and
    details. Some rows are decided among their candidates, others chosen again wider (a flat
    row's nucleus or typical set beyond them, a nucleus ending inside a tie at the last
    candidate); all give the per-row oracle's choices."""
    import engine.sampling.batch_choice as batch_choice

    vocab, num_rows = 20000, 40
    logits = _wide_batch(vocab, num_rows, 6)
    kinds = [
        {"top_p": 0.9},
        {"typical_p": 0.9},
        {"top_p": 0.95, "typical_p": 0.8},
        {"typical_p": 0.3},
        {},
    ]
    params = [
        SamplingParams(temperature=0.7 + 0.05 * (i % 5), seed=i, **kinds[i % 5],
                       repetition_penalty=1.2 if i % 3 == 0 else 1.0,
                       logprobs=i % 4 == 1, top_n_tokens=2)
        for i in range(num_rows)
    ]  # fmt: skip
    tie = (480 * math.exp(5.0) + 20 * math.exp(4.9)) / (
        480 * math.exp(5.0) + 100 * math.exp(4.9) + (vocab - 580) * math.exp(-10.0)
    )
    params[2] = SamplingParams(temperature=1.0, top_p=tie, seed=2)
    again: list[int] = []  # rows (of their chunk) chosen again at the second try
    choose_again = batch_choice._choose_again

    def counted(choices, rows, *args):  # type: ignore[no-untyped-def]
        if args[-1] == 1:
            again.extend(rows)
        choose_again(choices, rows, *args)

    monkeypatch.setattr(batch_choice, "_choose_again", counted)
    past = [list(range(i, 3000, 97)) for i in range(num_rows)]
    args = (logits, params, list(range(num_rows)), list(range(num_rows)), past,
            [1] * num_rows, [EOS] * num_rows)  # fmt: skip
    batched = sample_with_details(*args)
    assert batched == choices_row_by_row(*args)
    assert -1 not in batched.token_ids
    assert 2 in again
    assert 0 < len(again) < num_rows * 4 // 5


def test_vocabulary_sums_equal_the_sorted_sums() -> None:
    """Typical-p's normaliser and entropy summed in token id order equal the sums in
    descending order (`process_logits`'s) wherever they are reported certain, as most are."""
    from engine.sampling.batch_rules import _vocabulary_sums
    from engine.sampling.logits_processor import _normalised

    scores = _wide_batch(49152, 64, 7)
    total, entropy, certain = _vocabulary_sums(scores)
    ordered = scores.sort(dim=-1, descending=True).values
    probs, logp = _normalised(ordered)
    sorted_total = (ordered - ordered[:, :1]).exp().cumsum(-1)[:, -1:]
    sorted_entropy = -torch.where(probs > 0, probs * logp, 0.0).cumsum(-1)[:, -1:]
    assert int(certain.sum()) >= 60
    assert torch.equal(total[certain], sorted_total[certain])
    assert torch.equal(entropy[certain], sorted_entropy[certain])
