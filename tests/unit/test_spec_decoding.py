"""Speculative decoding inside continuous batching changes no token, only the step count.

Oracles: transformers' greedy `generate` (with the near-tie rule), the engine run one token per
step (the sequential reference, for per-token rules and logprobs), and the scripted double's
known acceptance lengths.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from engine.config import EngineConfig, SchedulerConfig
from engine.core import LLMEngine
from engine.model_runner import ModelRunner
from engine.outputs import EngineOutput
from engine.paths import model_path
from engine.sampling.params import SamplingParams
from engine.spec_decode.drafter import Drafter
from engine.spec_decode.loader import load_speculator
from engine.spec_decode.proposer import MLPProposer, Proposer
from tests.reference import chat_prompt_ids, compare_greedy, hf_greedy
from tools.scripted_proposer import ScriptedProposer
from tools.tiny_speculator import write_tiny_speculator

MAX_NEW = 24
TINY = "tiny-llama-gqa-tied"


@dataclass
class Run:
    token_ids: dict[str, list[int]] = field(default_factory=dict)
    outputs: dict[str, list[EngineOutput]] = field(default_factory=dict)

    def accepted(self, request_id: str) -> list[int]:
        """Drafts accepted at each speculative step of a request."""
        return [o.num_accepted_tokens for o in self.outputs[request_id] if o.draft_depth]


def make_engine(
    path: Path,
    proposer: Proposer | None = None,
    num_blocks: int = 512,
    max_batched_tokens: int = 4096,
    eos: frozenset[int] | None = None,
) -> LLMEngine:
    runner = ModelRunner(
        EngineConfig(path, dtype="float32", block_size=16, num_kv_blocks=num_blocks)
    )
    config = SchedulerConfig(
        max_num_seqs=32, max_num_batched_tokens=max_batched_tokens, max_model_len=2048
    )
    eos_ids = frozenset(runner.config.eos_token_ids) if eos is None else eos
    drafter = None if proposer is None else Drafter(proposer, None, max_batch_size=16)
    return LLMEngine(runner, config, eos_ids, drafter)


def run(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
) -> Run:
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    result = Run()
    for i, (prompt, p) in enumerate(zip(prompts, params_list, strict=True)):
        engine.add_request(str(i), prompt, p)
        result.token_ids[str(i)] = []
        result.outputs[str(i)] = []
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            result.token_ids[out.request_id] += out.new_token_ids
            result.outputs[out.request_id].append(out)
        engine.scheduler.check_integrity()
    assert engine.kv.num_used_blocks == 0
    return result


def attach_speculator(
    engine: LLMEngine, spec_path: Path, top_k: list[int], n_candidates: int
) -> None:
    """The speculator at `spec_path` drafts for `engine`, its full tree every step."""
    speculator = load_speculator(
        spec_path,
        hidden_size=engine.runner.config.hidden_size,
        vocab_size=engine.runner.config.vocab_size,
        dtype=engine.runner.dtype,
        device="cpu",
    )
    engine.drafter = Drafter(MLPProposer(speculator, top_k, n_candidates), None, 16)


def tiny_prompts(path: Path, n: int = 2) -> list[list[int]]:
    """Prompts of unequal lengths (as fms-extras' equivalence test)."""
    prompts = [list(p) for p in chat_prompt_ids(path)]
    return [prompts[0], prompts[16], prompts[17], prompts[5], prompts[9], prompts[12]][:n]


@pytest.mark.parametrize("n_predict", [1, 2, 3, 4])
@pytest.mark.parametrize("n_candidates", [1, 3, 5])
def test_scripted_drafts_give_the_expected_steps(n_predict: int, n_candidates: int) -> None:
    path = model_path(TINY)
    prompts = tiny_prompts(path)
    refs = [hf_greedy(path, tuple(p), MAX_NEW) for p in prompts]
    double = ScriptedProposer(
        [p + r.token_ids for p, r in zip(prompts, refs, strict=True)],
        accept_lengths=[0, 1, 2, 3, 4, 2, 1, 4],
        num_heads=n_predict,
        n_candidates=n_candidates,
    )
    result = run(make_engine(path, double), prompts, SamplingParams(max_new_tokens=MAX_NEW))
    for i, ref in enumerate(refs):
        tokens = result.token_ids[str(i)]
        if compare_greedy(tokens, ref):
            continue  # a near-tie moved off the scripted truth
        assert result.accepted(str(i)) == double.expected[str(i)]
        assert len(result.outputs[str(i)]) == expected_steps(
            MAX_NEW, n_predict, double.accept_lengths
        )


def expected_steps(max_new_tokens: int, num_heads: int, accept_lengths: list[int]) -> int:
    """Steps to generate `max_new_tokens` when the s-th speculative step accepts
    `accept_lengths[s]` drafts (cycling; at most the depth left) plus its own token."""
    generated, steps, s = 1, 1, 0  # the prefill step makes the first token
    while generated < max_new_tokens:
        depth = min(num_heads, max_new_tokens - generated - 1)
        accepted = 0
        if depth >= 1:
            accepted = min(accept_lengths[s % len(accept_lengths)], depth)
            s += 1
        generated += accepted + 1
        steps += 1
    return steps


@pytest.mark.parametrize(
    ("n_predict", "top_k", "n_candidates", "tie"),
    [
        (1, [3], 2, False),
        (2, [4, 2], 5, True),
        (3, [5, 3, 2], 5, False),
        (4, [4, 3, 2, 2], 8, True),
    ],
)
def test_mlp_speculator_output_equals_transformers(
    tmp_path: Path, tiny_path: Path, n_predict: int, top_k: list[int], n_candidates: int, tie: bool
) -> None:
    spec_path = write_tiny_speculator(
        tmp_path / "spec", tiny_path, n_predict=n_predict, tie_weights=tie, scale_input=tie
    )
    engine = make_engine(tiny_path)
    attach_speculator(engine, spec_path, top_k, n_candidates)
    prompts = tiny_prompts(tiny_path, 3)
    result = run(engine, prompts, SamplingParams(max_new_tokens=MAX_NEW))
    for i, prompt in enumerate(prompts):
        compare_greedy(result.token_ids[str(i)], hf_greedy(tiny_path, tuple(prompt), MAX_NEW))
        assert sum(o.draft_depth > 0 for o in result.outputs[str(i)]) > 0


def test_random_speculator_sampling_equals_plain_sampling(tmp_path: Path) -> None:
    """Seeded sampled requests (top-k, top-p) with a random MLP speculator's [4, 3, 2] x 5
    trees: the same tokens as without a speculator."""
    path = model_path(TINY)
    spec_path = write_tiny_speculator(tmp_path / "spec", path, n_predict=3)
    params = [
        SamplingParams(max_new_tokens=MAX_NEW, temperature=0.7, top_k=5, seed=11),
        SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, top_p=0.5, seed=12),
        SamplingParams(max_new_tokens=MAX_NEW),
    ]
    prompts = tiny_prompts(path, 3)
    plain = run(make_engine(path), prompts, params)
    engine = make_engine(path)
    attach_speculator(engine, spec_path, [4, 3, 2], 5)
    spec = run(engine, prompts, params)
    assert spec.token_ids == plain.token_ids
    assert all(any(o.draft_depth for o in spec.outputs[str(i)]) for i in range(3))


def _scripted_pair(
    params: SamplingParams | list[SamplingParams],
    eos: frozenset[int] | None = None,
    n: int = 4,
    accept_lengths: tuple[int, ...] = (4, 3, 4, 1),
) -> tuple[Run, Run, ScriptedProposer]:
    """The same requests one token per step, then with scripted drafts of that output."""
    path = model_path(TINY)
    prompts = tiny_prompts(path, n)
    plain = run(make_engine(path, eos=eos), prompts, params)
    sequences = [p + plain.token_ids[str(i)] for i, p in enumerate(prompts)]
    double = ScriptedProposer(sequences, accept_lengths, num_heads=4, n_candidates=3)
    spec = run(make_engine(path, double, eos=eos), prompts, params)
    return plain, spec, double


def _assert_same(plain: Run, spec: Run, logprob_atol: float = 1e-4) -> None:
    for request_id, tokens in plain.token_ids.items():
        assert spec.token_ids[request_id] == tokens, request_id
        assert spec.outputs[request_id][-1].status == plain.outputs[request_id][-1].status
        plain_lps = [lp for o in plain.outputs[request_id] for lp in o.logprobs or []]
        spec_lps = [lp for o in spec.outputs[request_id] for lp in o.logprobs or []]
        assert len(plain_lps) == len(spec_lps)
        for a, b in zip(plain_lps, spec_lps, strict=True):
            assert (a.token_id, a.rank, a.top_token_ids) == (b.token_id, b.rank, b.top_token_ids)
            assert abs(a.logprob - b.logprob) < logprob_atol
            for x, y in zip(a.top_logprobs, b.top_logprobs, strict=True):
                assert abs(x - y) < logprob_atol


def test_per_token_rules_hold_inside_accepted_runs() -> None:
    path = model_path(TINY)
    first_tokens = hf_greedy(path, tuple(tiny_prompts(path, 1)[0]), 8).token_ids
    eos = frozenset({first_tokens[2]})  # EOS comes up inside the first accepted run
    params = [
        SamplingParams(max_new_tokens=MAX_NEW, min_new_tokens=6, logprobs=True, top_n_tokens=3),
        SamplingParams(max_new_tokens=MAX_NEW, repetition_penalty=1.5, logprobs=True),
        SamplingParams(max_new_tokens=MAX_NEW, length_penalty=(2, 1.5)),
        SamplingParams(max_new_tokens=7, stop_token_ids=(first_tokens[5],)),
    ]
    plain, spec, _ = _scripted_pair(params, eos=eos)
    _assert_same(plain, spec)
    assert plain.token_ids["0"][:6].count(first_tokens[2]) == 0  # EOS suppressed until 6
    assert any(a >= 2 for a in spec.accepted("1"))
    assert len(spec.outputs["1"]) < len(plain.outputs["1"])


def test_sampling_requests_speculate_with_plain_sampling_tokens() -> None:
    """Seeded sampled requests beside greedy ones: drafts of their plain-sampled output are
    accepted, and every token, stop and detail equals plain sampling's."""
    params = [
        SamplingParams(max_new_tokens=MAX_NEW),
        SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, top_k=20, seed=7, logprobs=True),
        SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True),
        SamplingParams(max_new_tokens=MAX_NEW, temperature=1.2, top_p=0.9, seed=3),
        SamplingParams(max_new_tokens=MAX_NEW, temperature=0.7, typical_p=0.8, seed=2**64 - 1),
        SamplingParams(
            max_new_tokens=MAX_NEW, temperature=0.3, repetition_penalty=1.3, seed=0, logprobs=True
        ),
    ]
    plain, spec, _ = _scripted_pair(params, n=6)
    _assert_same(plain, spec)
    for request_id in map(str, range(6)):
        assert any(a >= 2 for a in spec.accepted(request_id)), request_id


def test_drafter_detached_and_attached_between_steps() -> None:
    """`set_drafter` between any two steps, drafts pending or not: the same tokens as plain
    decoding, and speculation resumes once attached again."""
    path = model_path(TINY)
    prompts = tiny_prompts(path, 3)
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, seed=5)
    plain = run(make_engine(path), prompts, params)
    sequences = [p + plain.token_ids[str(i)] for i, p in enumerate(prompts)]
    engine = make_engine(path, ScriptedProposer(sequences, (4, 2), num_heads=4, n_candidates=2))
    drafter = engine.drafter
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(3)}
    num_steps = num_spec_steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            tokens[out.request_id] += out.new_token_ids
            num_spec_steps += out.draft_depth > 0
        num_steps += 1
        engine.set_drafter(None if num_steps % 3 == 0 else drafter)
        engine.scheduler.check_integrity()
    assert tokens == plain.token_ids
    assert num_spec_steps > 0 and engine.kv.num_used_blocks == 0


def test_chunked_prefill_and_preemption_with_speculation() -> None:
    path = model_path(TINY)
    prompts = tiny_prompts(path, 4)
    refs = [hf_greedy(path, tuple(p), MAX_NEW) for p in prompts]
    double = ScriptedProposer(
        [p + r.token_ids for p, r in zip(prompts, refs, strict=True)], (4, 2, 3), 4, 5
    )
    engine = make_engine(path, double, num_blocks=16, max_batched_tokens=40)
    result = run(engine, prompts, SamplingParams(max_new_tokens=MAX_NEW))
    assert any(o.draft_depth for outs in result.outputs.values() for o in outs)
    for i, ref in enumerate(refs):
        compare_greedy(result.token_ids[str(i)], ref)


def test_no_block_leak_over_500_requests_with_cancellations() -> None:
    path = model_path(TINY)
    prompts = [list(p) for p in chat_prompt_ids(path)]
    plain = run(make_engine(path), prompts, SamplingParams(max_new_tokens=12))
    double = ScriptedProposer(
        [p + plain.token_ids[str(i)] for i, p in enumerate(prompts)], (4, 0, 2, 3, 1), 4, 3
    )
    engine = make_engine(path, double, num_blocks=40, max_batched_tokens=256)
    rng = random.Random(0)
    expected: dict[str, list[int]] = {}
    got: dict[str, list[int]] = {}
    cancel_at: dict[str, int] = {}
    num_added = 0
    step = 0
    while num_added < 500 or engine.has_unfinished_requests():
        while num_added < 500 and engine.scheduler.num_waiting < 8:
            request_id = f"r{num_added}"
            k = num_added % len(prompts)
            engine.add_request(request_id, prompts[k], SamplingParams(max_new_tokens=12))
            expected[request_id] = plain.token_ids[str(k)]
            got[request_id] = []
            if rng.random() < 0.3:
                cancel_at[request_id] = step + rng.randint(0, 6)
            num_added += 1
        for request_id, at in list(cancel_at.items()):
            if at == step:
                engine.abort_request(request_id)
                del expected[request_id]
        for out in engine.step().outputs:
            got[out.request_id] += out.new_token_ids
        engine.scheduler.check_integrity()
        step += 1
    assert engine.kv.num_used_blocks == 0 and engine.kv.num_free_blocks == 40
    assert sum(len(v) for v in double.expected.values()) > 500
    for request_id, tokens in expected.items():
        assert got[request_id] == tokens, request_id


def test_smollm2_with_scripted_and_random_speculators(tmp_path: Path, smollm2_path: Path) -> None:
    prompts = [list(p) for p in chat_prompt_ids(smollm2_path)][:8]
    refs = [hf_greedy(smollm2_path, tuple(p), 64) for p in prompts]  # cached by test_llama
    double = ScriptedProposer(
        [p + r.token_ids for p, r in zip(prompts, refs, strict=True)],
        accept_lengths=(3, 0, 2, 1, 3),
        num_heads=3,
        n_candidates=5,
    )
    result = run(make_engine(smollm2_path, double), prompts, SamplingParams(max_new_tokens=64))
    for i, ref in enumerate(refs):
        if not compare_greedy(result.token_ids[str(i)], ref):
            assert (
                result.accepted(str(i)) == double.expected[str(i)][: len(result.accepted(str(i)))]
            )
    spec_path = write_tiny_speculator(tmp_path / "spec", smollm2_path, inner_dim=32)
    engine = make_engine(smollm2_path)
    speculator = load_speculator(
        spec_path, hidden_size=576, vocab_size=49152, dtype=engine.runner.dtype, device="cpu"
    )
    engine.drafter = Drafter(MLPProposer(speculator), None, 16)
    result = run(engine, prompts[:4], SamplingParams(max_new_tokens=32))
    for i, prompt in enumerate(prompts[:4]):
        compare_greedy(result.token_ids[str(i)], hf_greedy(smollm2_path, tuple(prompt), 32))
