"""The step loop end to end: chunked prefill, preemption and mixed batches change no token."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig, SchedulerConfig
from engine.core import LLMEngine
from engine.model_runner import ModelRunner
from engine.sampling.params import SamplingParams
from tests.reference import chat_prompt_ids, compare_greedy, hf_greedy

MAX_NEW = 24


def runner_config(path: Path, num_blocks: int) -> EngineConfig:
    return EngineConfig(path, dtype="float32", block_size=16, num_kv_blocks=num_blocks)


def run_all(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            tokens[out.request_id] += out.new_token_ids
        engine.scheduler.check_integrity()
    assert engine.kv.num_used_blocks == 0
    return [tokens[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize(
    ("num_blocks", "max_batched_tokens"),
    [(512, 4096), (512, 16), (14, 64)],
    ids=["ample", "chunked-prefill", "preempting"],
)
def test_engine_matches_transformers(
    tiny_path: Path, num_blocks: int, max_batched_tokens: int
) -> None:
    runner = ModelRunner(runner_config(tiny_path, num_blocks))
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=max_batched_tokens, max_model_len=2048
    )
    engine = LLMEngine(runner, config, frozenset(runner.config.eos_token_ids))
    prompts = [list(p) for p in chat_prompt_ids(tiny_path)[:10]]
    outputs = run_all(engine, prompts, SamplingParams(max_new_tokens=MAX_NEW))
    for prompt, tokens in zip(prompts, outputs, strict=True):
        compare_greedy(tokens, hf_greedy(tiny_path, tuple(prompt), MAX_NEW))


def test_prefix_cache_hits_change_no_token(tiny_path: Path) -> None:
    """Prompts sharing the chat template's system prompt, then the same prompts again (whole
    prompts cached but their last token): every request starts after a cached prefix."""
    runner = ModelRunner(runner_config(tiny_path, 64))
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=2048)
    engine = LLMEngine(runner, config, frozenset(runner.config.eos_token_ids))
    prompts = [list(p) for p in chat_prompt_ids(tiny_path)[:6]]
    first = run_all(engine, prompts, SamplingParams(max_new_tokens=MAX_NEW))
    hits = engine.kv.num_prefix_hit_tokens
    again = run_all(engine, prompts, SamplingParams(max_new_tokens=MAX_NEW))
    assert hits > 0
    assert engine.kv.num_prefix_hit_tokens - hits >= sum((len(p) - 1) // 16 * 16 for p in prompts)
    for prompt, a, b in zip(prompts, first, again, strict=True):
        reference = hf_greedy(tiny_path, tuple(prompt), MAX_NEW)
        compare_greedy(a, reference)
        compare_greedy(b, reference)


def test_min_new_tokens_suppresses_eos(tiny_path: Path) -> None:
    runner = ModelRunner(EngineConfig(tiny_path, dtype="float32", num_kv_blocks=64))
    first = hf_greedy(tiny_path, tuple(chat_prompt_ids(tiny_path)[0]), 1).token_ids[0]
    # Declare the first greedy token to be EOS: without min_new_tokens it ends the request.
    engine = LLMEngine(runner, SchedulerConfig(max_num_seqs=4), frozenset({first}))
    prompt = list(chat_prompt_ids(tiny_path)[0])
    assert run_all(engine, [prompt], SamplingParams(max_new_tokens=8)) == [[first]]
    out = run_all(engine, [prompt], SamplingParams(max_new_tokens=8, min_new_tokens=3))[0]
    assert len(out) >= 3 and first not in out[:3]
