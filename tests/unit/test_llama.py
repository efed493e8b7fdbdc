"""The engine is the same model as transformers' Llama: greedy tokens and logits."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine import LLM
from engine.step_io import SequenceInput
from tests.reference import chat_prompt_ids, compare_greedy, hf_greedy

MAX_NEW = 64


def _check_all(path: Path, llm: LLM, batched: bool) -> int:
    prompts = [list(p) for p in chat_prompt_ids(path)]
    if batched:
        outs = llm.generate(prompts, MAX_NEW, return_logits=True)
    else:
        outs = [llm.generate([p], MAX_NEW, return_logits=True)[0] for p in prompts]
    near_ties = 0
    for prompt, out in zip(prompts, outs, strict=True):
        ref = hf_greedy(path, tuple(prompt), MAX_NEW)
        near_ties += compare_greedy(out.token_ids, ref, out.logits)
    return near_ties


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path) -> Iterator[LLM]:
    llm = LLM(smollm2_path, dtype="float32")
    yield llm
    llm.kv.check_integrity()


@pytest.fixture(autouse=True)
def _no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    for name in ("smollm2", "tiny"):
        if name in request.fixturenames:
            llm: LLM = request.getfixturevalue(name)
            llm.kv.check_integrity()
            assert llm.kv.num_used_blocks == 0


@pytest.mark.parametrize("batched", [False, True], ids=["one-by-one", "batched"])
def test_smollm2_matches_transformers(smollm2: LLM, smollm2_path: Path, batched: bool) -> None:
    near_ties = _check_all(smollm2_path, smollm2, batched)
    print(f"SmolLM2 {'batched' if batched else 'one-by-one'}: {near_ties} near-ties")


@pytest.fixture(scope="module", params=[True, False], ids=["fused", "aten"])
def tiny(tiny_path: Path, request: pytest.FixtureRequest) -> Iterator[LLM]:
    """Each tiny model with the fused CPU kernels and with the same maths as ATen ops."""
    yield LLM(tiny_path, dtype="float32", max_num_tokens=8192, cpu_kernels=request.param)


@pytest.mark.parametrize("batched", [False, True], ids=["one-by-one", "batched"])
def test_tiny_matches_transformers(tiny: LLM, tiny_path: Path, batched: bool) -> None:
    _check_all(tiny_path, tiny, batched)


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_output_independent_of_batch_and_block_size(tiny_path: Path, block_size: int) -> None:
    """A prompt's tokens and logits do not depend on its batch-mates or on the block size."""
    llm = LLM(tiny_path, dtype="float32", block_size=block_size, max_num_tokens=8192)
    prompts = [list(p) for p in chat_prompt_ids(tiny_path)]
    alone = llm.generate([prompts[0]], 40, return_logits=True)[0]
    mixed = llm.generate(prompts[:7], 40, return_logits=True)[0]
    assert mixed.token_ids == alone.token_ids
    for a, b in zip(alone.logits, mixed.logits, strict=True):
        assert (a - b).abs().max().item() < 1e-4
    compare_greedy(alone.token_ids, hf_greedy(tiny_path, tuple(prompts[0]), 40), alone.logits)
    llm.kv.check_integrity()
    assert llm.kv.num_used_blocks == 0


def test_text_prompts_and_seeded_sampling(tiny: LLM) -> None:
    a = tiny.generate(["Hello there", "Tell me a story"], 16, temperature=0.8, top_p=0.9, seed=7)
    b = tiny.generate(["Tell me a story"], 16, temperature=0.8, top_p=0.9, seed=7)
    assert a[1].token_ids == b[0].token_ids  # same seed, other batch-mates
    assert a[1].text == tiny.tokenizer.decode(b[0].token_ids, skip_special_tokens=True)
    c = tiny.generate(["Tell me a story"], 16, temperature=0.8, top_p=0.9, seed=8)
    assert c[0].token_ids != b[0].token_ids


def test_smollm2_block_size_independent(smollm2: LLM, smollm2_path: Path) -> None:
    prompts = [list(p) for p in chat_prompt_ids(smollm2_path)[:3]]
    base = smollm2.generate(prompts, 16)
    for block_size in (1, 32):
        llm = LLM(smollm2_path, dtype="float32", block_size=block_size, max_num_tokens=2048)
        outs = llm.generate(prompts, 16)
        assert [o.token_ids for o in outs] == [o.token_ids for o in base]
        llm.kv.check_integrity()


def test_step_outputs_outlive_the_next_step(tiny: LLM, tiny_path: Path) -> None:
    """A decode step's logits and hidden states stay as they were through the next steps (a
    decoder layer's outputs reuse memory from step to step; what a step returns must not)."""
    prompt = list(chat_prompt_ids(tiny_path)[0])
    kv, runner, vocab = tiny.kv, tiny.runner, tiny.runner.config.vocab_size
    kv.allocate_slots("outlive", len(prompt) + 3)
    try:
        table = kv.block_table("outlive")
        token = int(runner.execute([SequenceInput(prompt, 0, table)]).logits[-1].argmax())
        first = runner.execute([SequenceInput([token], len(prompt), table)])
        logits, hidden = first.logits.clone(), first.hidden_states.clone()
        for i in (1, 2):
            step = SequenceInput([(token + i) % vocab], len(prompt) + i, table)
            assert not torch.equal(runner.execute([step]).hidden_states, hidden)
        assert torch.equal(first.logits, logits)
        assert torch.equal(first.hidden_states, hidden)
    finally:
        kv.free("outlive")
