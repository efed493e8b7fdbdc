"""OpenAI's additive rules (`logit_bias`, `presence_penalty`, `frequency_penalty`): their
parameter checks; the batched sampler against the per-row oracle (`tests/sampling_oracle.py`),
mixed with every TGIS rule, greedy and sampled rows and a draft tree's rows; a hand-computed
case; and speculation (scripted drafts, a random MLP speculator) giving the tokens of plain
decoding."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.paths import model_path
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import sample_with_details
from tests.sampling_oracle import choices_row_by_row
from tests.unit.test_spec_decoding import (
    TINY,
    Run,
    attach_speculator,
    make_engine,
    run,
    tiny_prompts,
)
from tools.scripted_proposer import ScriptedProposer
from tools.tiny_speculator import write_tiny_speculator

VOCAB = 500
EOS = frozenset({2, 7})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty must be between -2.0 and 2.0, got 2.5"),
        ({"presence_penalty": math.nan}, "presence_penalty must be between -2.0 and 2.0"),
        ({"frequency_penalty": -2.01}, "frequency_penalty must be between -2.0 and 2.0"),
        ({"frequency_penalty": math.inf}, "frequency_penalty must be between -2.0 and 2.0"),
        ({"logit_bias": {5: 100.5}}, r"logit_bias\[5\] must be between -100 and 100, got 100.5"),
        ({"logit_bias": {5: math.nan}}, r"logit_bias\[5\] must be between -100 and 100"),
        ({"logit_bias": {5: "1"}}, r"logit_bias\[5\] must be a number"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {True: 1.0}}, "logit_bias keys must be token ids"),
        ({"logit_bias": [(5, 1.0)]}, "logit_bias must map token ids to biases"),
    ],
)
def test_parameter_checks(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def test_parameters_at_their_bounds() -> None:
    bias = {0: -100, 3: 100.0, 9: 0.5}
    p = SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, logit_bias=bias)
    bias[0] = 1e9  # the params keep their own copy
    assert p.logit_bias == {0: -100.0, 3: 100.0, 9: 0.5}
    assert p.has_additive_rules and hash(p) == hash(
        SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0)
    )
    assert not SamplingParams(logit_bias={}).has_additive_rules
    p.check_token_ids(10)
    with pytest.raises(ValueError, match=r"logit_bias token id 9 is outside the vocabulary \(0 "
                                         r"to 8\)"):  # fmt: skip
        p.check_token_ids(9)


def test_engine_refuses_bias_outside_the_vocabulary() -> None:
    engine = make_engine(model_path(TINY), num_blocks=16)
    vocab = engine.runner.config.vocab_size
    with pytest.raises(ValueError, match=f"logit_bias token id {vocab} is outside"):
        engine.add_request("r", [1, 2, 3], SamplingParams(logit_bias={vocab: 1.0}))
    assert not engine.has_unfinished_requests()


def test_hand_computed_adjustment() -> None:
    """Zero logits, generated [3, 3, 5]: token 3 loses 0.5 + 2 * 0.25, token 5 0.5 + 0.25,
    token 1 gains its bias 2, token 5 its bias 0.25 too; the logprobs are those of that vector."""
    params = SamplingParams(
        presence_penalty=0.5,
        frequency_penalty=0.25,
        logit_bias={1: 2.0, 5: 0.25},
        logprobs=True,
        top_n_tokens=2,
    )
    logits = torch.zeros(1, 8)
    choices = sample_with_details(logits, [params], [None], [3], [[]], [3], [EOS], [[3, 3, 5]])
    expected = torch.tensor([0.0, 2.0, 0.0, -1.0, 0.0, -0.5, 0.0, 0.0]).log_softmax(-1)
    detail = choices.details[0]
    assert choices.token_ids == [1] and detail is not None
    assert detail.logprob == pytest.approx(float(expected[1]))
    # the top two: token 1, then the five tokens tied at 0 (ties kept, lower ids first)
    assert detail.top_token_ids == (1, 0, 2, 4, 6, 7)
    assert detail.top_logprobs[1] == pytest.approx(float(expected[0]))


_ADDITIVE = [
    {"presence_penalty": 1.5},
    {"frequency_penalty": 0.8},
    {"presence_penalty": -0.7, "frequency_penalty": 1.9},
    {"logit_bias": {100: 5.0, 101: -100.0, 7: 3.0}},  # 7 is an EOS id
    {"logit_bias": {3: 100.0}},  # a forced token
    {"presence_penalty": 2.0, "frequency_penalty": -0.3, "logit_bias": {11: -4.0, 40: 1.5}},
]
_TGIS = [
    {},
    {"temperature": 0.8},
    {"temperature": 1.2, "top_k": 5},
    {"temperature": 0.9, "top_p": 0.8},
    {"temperature": 1.0, "typical_p": 0.6},
    {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "repetition_penalty": 1.3},
    {"repetition_penalty": 1.4},
    {"logprobs": True, "top_n_tokens": 3},
    {"temperature": 1.1, "repetition_penalty": 0.8, "logprobs": True, "top_n_tokens": 2},
    {"min_new_tokens": 4},
    {"length_penalty": (1, 1.6), "temperature": 0.9},
]


def _batch(seed: int) -> tuple[list[tuple[Any, ...]], torch.Tensor]:
    """Every additive rule with every TGIS rule kind, rows without additive rules between
    them, then a draft tree's nodes (one seeded request at several positions, each node's
    generated tokens extended by the drafts on its path)."""
    g = torch.Generator().manual_seed(seed)
    rows: list[tuple[Any, ...]] = []
    kinds = list(itertools.product([*_ADDITIVE, {}], _TGIS))
    for n, (additive, tgis) in enumerate(kinds):
        params = SamplingParams(max_new_tokens=32, seed=500 + n, **{**tgis, **additive})
        size = int(torch.randint(0, 30, (1,), generator=g))
        generated = torch.randint(0, 60, (size,), generator=g).tolist()  # repeats likely
        prompt = torch.randint(0, VOCAB, (5,), generator=g).tolist()
        rows.append((params, 500 + n, 40 + n, prompt + generated, len(generated), generated))
    tree = SamplingParams(max_new_tokens=32, seed=77, temperature=0.9, top_k=30,
                          repetition_penalty=1.2, presence_penalty=0.6, frequency_penalty=1.1,
                          logit_bias={17: 2.0}, logprobs=True, top_n_tokens=2)  # fmt: skip
    prompt, generated = [5, 9, 11], [17, 31, 17]
    for path in ([], [17], [17, 17], [31], [31, 44]):
        out = generated + path
        rows.append((tree, 77, 60 + len(path), prompt + out, len(out), out))
    logits = torch.randn(len(rows), VOCAB, generator=g) * 3
    logits[:, :60] += 2.0  # the generated tokens among the best: penalties move choices
    logits[::5, 7] = logits[::5].max(-1).values  # an EOS at the top: the EOS rules decide
    logits[4, 11] = float("nan")
    return rows, logits


def _columns(rows: list[tuple[Any, ...]]) -> tuple[list[Any], ...]:
    columns = [list(c) for c in zip(*rows, strict=True)]  # params .. generated
    return (*columns[:5], [EOS] * len(rows), columns[5])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_rules_equal_the_per_row_rules(seed: int) -> None:
    rows, logits = _batch(seed)
    params, seeds, positions, past, num_generated, eos, generated = _columns(rows)
    args = (logits, params, seeds, positions, past, num_generated, eos)
    batched = sample_with_details(*args, generated)
    oracle = choices_row_by_row(*args, generated)
    assert batched.errors == oracle.errors
    assert batched.token_ids == oracle.token_ids
    assert batched.details == oracle.details
    assert sum(e is not None for e in batched.errors) == 1
    without = sample_with_details(*args)  # the additive rules change many choices
    assert sum(a != b for a, b in zip(batched.token_ids, without.token_ids, strict=True)) >= 10
    # a bias of 100 wins, unless a due length penalty raised EOS far above it
    forced = [i for i, p in enumerate(params) if p.logit_bias == {3: 100.0} and
              p.length_penalty is None and batched.errors[i] is None]  # fmt: skip
    assert len(forced) >= 8 and all(batched.token_ids[i] == 3 for i in forced)


def test_rows_chosen_again_get_the_rules_once() -> None:
    """Top-k ties beyond the candidates and flat top-p rows (chosen again over the whole
    vocabulary) with additive rules: the rules apply once, as per row."""
    vocab = 5000
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(6, vocab, generator=g) * 0.05  # flat: nuclei beyond the candidates
    logits[:3, 200:220] = 8.0  # twenty ties at the 3rd score
    logits[:3, 50] = 9.0
    params = [
        SamplingParams(temperature=1.0, seed=i, logprobs=True, top_n_tokens=30,
                       presence_penalty=1.0, frequency_penalty=0.5,
                       logit_bias={205: 0.5, 50: -0.5}, **({"top_k": 3} if i < 3 else
                                                          {"top_p": 0.6}))
        for i in range(6)
    ]  # fmt: skip
    generated = [[200, 201, 201, 50], [], [210] * 5, [1, 2, 3], list(range(0, 4000, 3)), [9]]
    args = (logits, params, list(range(6)), list(range(6)), [[]] * 6, [0] * 6, [EOS] * 6)
    batched = sample_with_details(*args, generated)
    assert batched == choices_row_by_row(*args, generated)
    assert -1 not in batched.token_ids


# Speculation: the drafts on the path to a tree node count as generated tokens there.

MAX_NEW = 24
_FAVOURED = {13: 100.0, 42: 100.0, 77: 100.0, 1000: 100.0}
"""Biases that confine the tiny model (whose logits span far more than the penalties' range)
to four tokens, so that the counts decide among them."""
_ENGINE_PARAMS = [
    SamplingParams(max_new_tokens=MAX_NEW, frequency_penalty=1.5, logit_bias=_FAVOURED,
                   logprobs=True, top_n_tokens=2),
    SamplingParams(max_new_tokens=MAX_NEW, presence_penalty=2.0, frequency_penalty=1.5,
                   repetition_penalty=1.2, logit_bias=_FAVOURED),
    SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, top_k=20, seed=7,
                   frequency_penalty=0.9, presence_penalty=0.4, logit_bias=_FAVOURED,
                   logprobs=True),
    SamplingParams(max_new_tokens=MAX_NEW, temperature=1.1, top_p=0.9, seed=3,
                   frequency_penalty=1.0, presence_penalty=1.7,
                   logit_bias={**_FAVOURED, 29: -100.0}),
    SamplingParams(max_new_tokens=MAX_NEW, temperature=0.6, seed=11, frequency_penalty=1.2,
                   presence_penalty=-0.5, repetition_penalty=1.3, min_new_tokens=4,
                   logit_bias=_FAVOURED),
    SamplingParams(max_new_tokens=MAX_NEW, frequency_penalty=2.0, length_penalty=(5, 1.2),
                   logit_bias=_FAVOURED),
]  # fmt: skip


def _assert_same(plain: Run, spec: Run) -> None:
    for request_id, tokens in plain.token_ids.items():
        assert spec.token_ids[request_id] == tokens, request_id
        plain_lps = [lp for o in plain.outputs[request_id] for lp in o.logprobs or []]
        spec_lps = [lp for o in spec.outputs[request_id] for lp in o.logprobs or []]
        assert [(a.token_id, a.rank, a.top_token_ids) for a in plain_lps] == [
            (b.token_id, b.rank, b.top_token_ids) for b in spec_lps
        ]
        for a, b in zip(plain_lps, spec_lps, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_scripted_drafts_equal_plain_decoding() -> None:
    """Drafts of each request's plain output are accepted several at a time, and every token
    and detail equals plain decoding's: counts along a path include its drafts."""
    path = model_path(TINY)
    prompts = tiny_prompts(path, len(_ENGINE_PARAMS))
    plain = run(make_engine(path), prompts, _ENGINE_PARAMS)
    uncounted = [replace(p, presence_penalty=0.0, frequency_penalty=0.0) for p in _ENGINE_PARAMS]
    bias_only = run(make_engine(path), prompts, uncounted)
    for i, tokens in plain.token_ids.items():  # the counts decide
        assert tokens != bias_only.token_ids[i]
    sequences = [p + plain.token_ids[str(i)] for i, p in enumerate(prompts)]
    double = ScriptedProposer(sequences, (4, 3, 4, 1), num_heads=4, n_candidates=3)
    spec = run(make_engine(path, double), prompts, _ENGINE_PARAMS)
    _assert_same(plain, spec)
    for request_id in plain.token_ids:
        assert any(a >= 2 for a in spec.accepted(request_id)), request_id
    assert 29 not in plain.token_ids["3"]


def test_random_speculator_equals_plain_decoding(tmp_path: Path) -> None:
    path = model_path(TINY)
    spec_path = write_tiny_speculator(tmp_path / "spec", path, n_predict=3)
    prompts = tiny_prompts(path, len(_ENGINE_PARAMS))
    plain = run(make_engine(path), prompts, _ENGINE_PARAMS)
    engine = make_engine(path)
    attach_speculator(engine, spec_path, [4, 3, 2], 5)
    spec = run(engine, prompts, _ENGINE_PARAMS)
    _assert_same(plain, spec)
    assert all(any(o.draft_depth for o in spec.outputs[i]) for i in plain.token_ids)
