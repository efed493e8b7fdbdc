"""No request can harm another, in the engine: a request whose own logits or token
choice fail finishes with FinishReason.ERROR alone, its batch goes on with exactly the tokens
transformers' greedy decoding gives, its blocks are freed and the engine keeps serving."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig, SchedulerConfig
from engine.core import LLMEngine
from engine.model_runner import ModelRunner
from engine.outputs import EngineOutput
from engine.paths import model_path
from engine.request import FinishReason
from engine.sampling.logits_processor import MAX_SCORE, process_eos, process_logits
from engine.sampling.params import SamplingParams
from engine.spec_decode.drafter import Drafter
from tests.reference import chat_prompt_ids, compare_greedy, hf_greedy, require_model
from tools.scripted_proposer import ScriptedProposer

MODEL = "tiny-llama-mha-untied"  # untied: poisoning an embedding row leaves lm_head intact
MAX_NEW = 16


def run(
    engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, EngineOutput]:
    """Run `requests` to completion; each request's tokens and its last output."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = {request_id: [] for request_id in requests}
    last: dict[str, EngineOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            tokens[out.request_id] += out.new_token_ids
            last[out.request_id] = out
        engine.scheduler.check_integrity()
    assert engine.kv.num_used_blocks == 0
    return {
        request_id: EngineOutput(request_id, tokens[request_id], out.status, error=out.error)
        for request_id, out in last.items()
    }


def make_engine(path: Path, cpu_kernels: bool, proposer: ScriptedProposer | None) -> LLMEngine:
    config = EngineConfig(path, dtype="float32", num_kv_blocks=256, cpu_kernels=cpu_kernels)
    runner = ModelRunner(config)
    drafter = None if proposer is None else Drafter(proposer, None, max_batch_size=8)
    return LLMEngine(
        runner, SchedulerConfig(max_num_seqs=8), frozenset(runner.config.eos_token_ids), drafter
    )


@pytest.fixture(scope="module")
def path() -> Path:
    return require_model(model_path(MODEL))


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "speculating"])
@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["fused", "aten"])
def test_non_finite_logits_fail_one_request(path: Path, cpu_kernels: bool, speculate: bool) -> None:
    """The victim's 4th greedy token gets a NaN embedding, so every row after it is NaN: the
    victim fails mid-decode (inside a draft tree when speculating), its neighbours do not."""
    prompts = [list(p) for p in chat_prompt_ids(path)[:3]]
    refs = [hf_greedy(path, tuple(p), MAX_NEW) for p in prompts]
    innocent_ids = {t for p, r in zip(prompts[1:], refs[1:], strict=True) for t in p + r.token_ids}
    victim = refs[0].token_ids
    poison_at = next(
        i
        for i in range(3, MAX_NEW)
        if victim[i] not in innocent_ids and victim[i] not in prompts[0] + victim[:i]
    )
    proposer = None
    if speculate:
        sequences = [p + r.token_ids for p, r in zip(prompts, refs, strict=True)]
        proposer = ScriptedProposer(sequences, [3, 1, 2], num_heads=3, n_candidates=2)
    engine = make_engine(path, cpu_kernels, proposer)
    with torch.no_grad():
        assert engine.runner.model.embed_tokens is not None
        engine.runner.model.embed_tokens[victim[poison_at]] = float("nan")
    params = SamplingParams(max_new_tokens=MAX_NEW)
    outs = run(engine, {str(i): (p, params) for i, p in enumerate(prompts)})

    failed = outs["0"]
    assert failed.finish_reason == FinishReason.ERROR
    assert failed.error == "the model produced non-finite logits for this request"
    assert failed.new_token_ids == victim[: len(failed.new_token_ids)]
    assert len(failed.new_token_ids) <= poison_at + 1
    for i in (1, 2):
        compare_greedy(outs[str(i)].new_token_ids, refs[i])
    again = run(engine, {"again": (prompts[1], params)})["again"]
    compare_greedy(again.new_token_ids, refs[1])


def test_failed_draw_fails_one_request(path: Path) -> None:
    """A temperature so small that the scaled scores overflow to inf: the draw fails for that
    request; greedy and sampled neighbours finish as they would alone."""
    prompts = [list(p) for p in chat_prompt_ids(path)[:3]]
    engine = make_engine(path, cpu_kernels=True, proposer=None)
    sampled = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.7, seed=3)
    alone = run(engine, {"s": (prompts[2], sampled)})["s"].new_token_ids
    outs = run(
        engine,
        {
            "bad": (prompts[0], SamplingParams(max_new_tokens=MAX_NEW, temperature=1e-40)),
            "greedy": (prompts[1], SamplingParams(max_new_tokens=MAX_NEW)),
            "sampled": (prompts[2], sampled),
        },
    )
    assert outs["bad"].finish_reason == FinishReason.ERROR
    assert outs["bad"].new_token_ids == []
    assert outs["bad"].error == (
        "token selection failed: the processed scores are not a probability distribution"
    )
    compare_greedy(outs["greedy"].new_token_ids, hf_greedy(path, tuple(prompts[1]), MAX_NEW))
    assert outs["sampled"].new_token_ids == alone


def test_length_penalty_cannot_overflow(path: Path) -> None:
    """decay 10 from token 0 with min_new_tokens 310: 10 ** 311 overflows a float; the EOS
    score is capped instead, so the request ends with EOS right at min_new_tokens."""
    prompt = list(chat_prompt_ids(path)[0])
    engine = make_engine(path, cpu_kernels=True, proposer=None)
    params = SamplingParams(max_new_tokens=316, min_new_tokens=310, length_penalty=(0, 10.0))
    out = run(engine, {"r": (prompt, params)})["r"]
    assert out.finish_reason == FinishReason.EOS_TOKEN
    assert len(out.new_token_ids) == 311 and out.new_token_ids[-1] in engine.eos_token_ids
    assert not engine.eos_token_ids & set(out.new_token_ids[:-1])


@pytest.mark.parametrize(("start", "decay"), [(0, 10.0), (5, 1.0001), (0, 1e-3), (200, 10.0)])
def test_process_eos_matches_exact_formula_below_the_cap(start: int, decay: float) -> None:
    """s + |s| * (decay ** (n - start) - 1) in exact arithmetic, clamped to +-MAX_SCORE."""
    logits = torch.tensor([[2.0, -3.0, 0.5, float("-inf")]] * 4)
    eos = frozenset({0, 1, 3})
    params = [SamplingParams(length_penalty=(start, decay))] * 4
    generated = [start, start + 1, start + 20, start + 400]
    out = process_eos(logits, params, generated, [eos] * 4)
    for row, n in enumerate(generated):
        for token in range(4):
            s = float(logits[row, token])
            expected = s
            if token in eos and n > start and s != float("-inf"):
                exponent = n - start
                big = exponent * torch.tensor(decay).log().item() > 70
                factor = float("inf") if big else decay**exponent
                expected = max(-MAX_SCORE, min(MAX_SCORE, s + abs(s) * (factor - 1)))
            assert float(out[row, token]) == pytest.approx(expected, rel=1e-6), (row, token)
    assert bool(torch.isfinite(out[:, :3]).all())


@pytest.mark.parametrize("penalty", [1e-38, 3e38])
def test_extreme_repetition_penalty_keeps_scores_finite(penalty: float) -> None:
    """HF's rule (negative scores times the penalty, others divided by it), clamped to
    +-MAX_SCORE, so a draw at temperature 0.05 still sees a distribution."""
    logits = torch.tensor([4.0, -2.0, 1.0, 0.5])
    params = SamplingParams(temperature=0.05, repetition_penalty=penalty)
    scores = process_logits(logits, params, [0, 1])
    penalised = [min(4.0 / penalty, MAX_SCORE), max(-2.0 * penalty, -MAX_SCORE)]
    expected = torch.tensor([*penalised, 1.0, 0.5]) / 0.05
    torch.testing.assert_close(scores, expected, rtol=1e-6, atol=0)
    assert bool(scores.softmax(-1).isfinite().all())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": float("nan")}, "temperature must be finite"),
        ({"temperature": float("inf")}, "temperature must be finite"),
        ({"top_p": float("nan")}, "top_p must be finite"),
        ({"typical_p": float("nan")}, "typical_p must be finite"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty must be finite"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be finite"),
        ({"length_penalty": (0, float("nan"))}, "length_penalty decay_factor must be finite"),
        ({"length_penalty": (0, float("inf"))}, "length_penalty decay_factor must be finite"),
        ({"length_penalty": (0, 0.0)}, "length_penalty decay_factor must be finite and positive"),
    ],
)
def test_sampling_params_reject_non_finite(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**kwargs)
