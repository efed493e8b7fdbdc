"""Tensor parallelism on CPU over gloo (engine/parallel): N shards against one.

The oracle is the one-shard engine (itself checked against transformers elsewhere): greedy
tokens must be identical except at a true near-tie of the one-shard logits (counted and
printed), logits equal within fp32 rounding, and every rank's KV cache must hold exactly its
KV heads of the one-shard cache. Also: start-up refusals, per-rank weight memory, and a
killed rank.
"""

from __future__ import annotations

import os
import signal
import time
from functools import cache
from pathlib import Path

import pytest
import torch

from engine.llm import LLM, GenerationOutput
from engine.models.config import LlamaConfig
from engine.parallel.channel import CAPACITY
from engine.parallel.runner import LeaderRunner
from engine.parallel.shard import ShardLayout
from engine.paths import default_model_path, model_path
from tests.reference import Reference, TreeRows, compare_greedy, require_model
from tools.server_process import free_port
from tools.tiny_speculator import write_tiny_speculator

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land"]
MAX_NEW_TOKENS = 16
MAX_NUM_TOKENS = 1024
CASES = [
    ("tiny-llama-gqa-tied", 2),  # 2 KV heads: one per rank
    ("tiny-llama-gqa-tied", 4),  # 2 KV heads replicated over 4 ranks
    ("tiny-llama-mha-untied", 2),  # untied embedding split by vocabulary rows
    ("tiny-llama-mha-untied", 4),
    ("SmolLM2-135M-Instruct", 3),  # 9 heads, 3 KV heads
]


def _path(name: str) -> Path:
    if name == default_model_path().name:
        return require_model(default_model_path())
    return require_model(model_path(name))


def _weight_bytes(llm: LLM) -> int:
    model = llm.runner.model
    tensors = [p for p in model.parameters()]
    tensors += [t for lin in model.linears() for t in (lin.storage, lin.bias) if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


@cache
def _one_shard(name: str) -> tuple[list[GenerationOutput], torch.Tensor, int]:
    """The one-shard engine's greedy outputs (with logits), its whole KV pool right after
    ([num_layers, 2, slots, kv_heads, head_dim]) and its weight bytes."""
    with LLM(_path(name), max_num_tokens=MAX_NUM_TOKENS) as llm:
        outputs = llm.generate(PROMPTS, MAX_NEW_TOKENS, return_logits=True)
        num_slots = llm.runner.num_blocks * llm.runner.block_size
        (kv,) = llm.runner.read_kv(list(range(num_slots)))
        return outputs, kv, _weight_bytes(llm)


def _compare(ours: list[GenerationOutput], ref: list[GenerationOutput]) -> int:
    """compare_greedy for every prompt; returns the number of near-ties."""
    near_ties = 0
    for a, b in zip(ours, ref, strict=True):
        near_ties += compare_greedy(a.token_ids, Reference(b.token_ids, b.logits), a.logits)
    return near_ties


@pytest.mark.parametrize(("name", "num_shards"), CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_shards_match_one_shard(name: str, num_shards: int, tmp_path: Path) -> None:
    path = _path(name)
    ref, ref_kv, ref_bytes = _one_shard(name)
    speculator = write_tiny_speculator(tmp_path / "speculator", path, n_predict=3)
    with LLM(
        path,
        max_num_tokens=MAX_NUM_TOKENS,
        speculator=speculator,
        adaptive_speculation=False,
        tensor_parallel_size=num_shards,
        master_port=free_port(),
    ) as llm:
        runner = llm.runner
        assert isinstance(runner, LeaderRunner) and runner.shard.size == num_shards
        drafter = llm.engine.drafter
        llm.engine.set_drafter(None)
        plain = llm.generate(PROMPTS, MAX_NEW_TOKENS, return_logits=True)
        num_slots = runner.num_blocks * runner.block_size
        kv_by_rank = runner.read_kv(list(range(num_slots)))
        llm.engine.scheduler.check_integrity()
        llm.engine.set_drafter(drafter)
        tree_rows = TreeRows()
        llm.engine.observers.append(tree_rows)
        speculated = llm.generate(PROMPTS, MAX_NEW_TOKENS, return_logits=True)
        assert tree_rows.count > 0  # tokens were chosen along verified draft trees
        llm.engine.scheduler.check_integrity()
        rank0_bytes = _weight_bytes(llm)
    near_ties = _compare(plain, ref), _compare(speculated, ref)
    print(f"{name} x{num_shards}: near-ties plain {near_ties[0]}, speculated {near_ties[1]}")

    config = LlamaConfig.from_folder(path)
    assert runner.num_blocks * runner.block_size == ref_kv.shape[2]
    if not any(near_ties):  # the same tokens went to the same slots
        for rank, kv in enumerate(kv_by_rank):
            layout = ShardLayout.of(config, rank, num_shards)
            heads = slice(layout.kv_head_start, layout.kv_head_start + layout.num_kv_heads)
            torch.testing.assert_close(kv, ref_kv[:, :, :, heads], atol=1e-4, rtol=1e-4)

    # Rank 0 holds 1/N of every split matrix; the norms are the only replicated weights.
    norm_bytes = (2 * config.num_layers + 1) * config.hidden_size * 4
    assert rank0_bytes <= (ref_bytes - norm_bytes) / num_shards * 1.01 + norm_bytes


def test_shards_that_do_not_split_the_model_are_refused() -> None:
    path = _path("SmolLM2-135M-Instruct")
    with pytest.raises(ValueError, match="2 shards cannot split the llama model evenly: its 9 "):
        LLM(path, tensor_parallel_size=2, master_port=free_port())
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        LLM(path, tensor_parallel_size=0)
    tiny, visible = _path("tiny-llama-gqa-tied"), torch.cuda.device_count()
    shards = 2 if visible < 2 else 4  # splits the tiny model; 4 on hosts with 2 or 3 GPUs
    if visible < shards:
        with pytest.raises(ValueError, match=f"{shards} shards need {shards} CUDA devices, "):
            LLM(tiny, device="cuda", tensor_parallel_size=shards, master_port=free_port())


def test_a_killed_rank_fails_every_later_step_naming_it() -> None:
    path = _path("tiny-llama-gqa-tied")
    with LLM(
        path, max_num_tokens=MAX_NUM_TOKENS, tensor_parallel_size=2, master_port=free_port()
    ) as llm:
        runner = llm.runner
        assert isinstance(runner, LeaderRunner)
        failures: list[str] = []
        runner.watch(failures.append)
        assert llm.generate(PROMPTS[:1], 4)[0].token_ids
        rank1 = runner.ranks.processes[1]
        assert rank1.pid is not None
        os.kill(rank1.pid, signal.SIGKILL)
        start = time.monotonic()
        for _ in range(2):  # the step that meets the dead rank, and any later one
            with pytest.raises(RuntimeError):
                llm.generate(PROMPTS[:1], 4)
        assert time.monotonic() - start < 30
        assert failures == ["shard rank 1 was killed by SIGKILL"]


def test_a_prompt_prefix_longer_than_the_step_buffer_matches_one_shard() -> None:
    """Prompt-tuning embeddings reach every rank (here in a second broadcast: 300 x hidden
    floats exceed `CAPACITY`)."""
    path = _path("tiny-llama-gqa-tied")
    hidden = LlamaConfig.from_folder(path).hidden_size
    prefix = torch.randn(300, hidden, generator=torch.Generator().manual_seed(0))
    assert prefix.numel() * 4 > CAPACITY
    with LLM(path, max_num_tokens=MAX_NUM_TOKENS) as llm:
        ref = llm.generate(PROMPTS, 8, return_logits=True, prompt_prefix=prefix)
    with LLM(
        path, max_num_tokens=MAX_NUM_TOKENS, tensor_parallel_size=2, master_port=free_port()
    ) as llm:
        ours = llm.generate(PROMPTS, 8, return_logits=True, prompt_prefix=prefix)
    print(f"prompt prefix x2: {_compare(ours, ref)} near-ties")
