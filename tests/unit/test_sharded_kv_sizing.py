"""A tensor-parallel engine sized by the device-memory rule (engine/kv_sizing) starts and
generates what one shard does.

Two gloo ranks on CPU; each rank's memory gauge is a `FixedMemory` (the figures a CUDA device
would report), so the KV pool follows the CUDA sizing rule: every rank runs its own profile
step during construction, their collectives meet, no profile step is left for rank 0 to
broadcast, and the pool is the smallest any rank can hold. The oracle is the one-shard engine
(itself checked against transformers elsewhere).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch.distributed as dist

from engine.builder import build_engine, load_tokenizer
from engine.config import EngineConfig
from engine.core import LLMEngine
from engine.hooks import LogitsRecorder
from engine.kv_sizing import DeviceMemory, kv_block_bytes, num_blocks_from_memory
from engine.llm import LLM
from engine.models.config import LlamaConfig
from engine.parallel.runner import LeaderRunner
from engine.parallel.shard import ShardLayout
from engine.paths import model_path
from engine.sampling.params import SamplingParams
from tests.reference import Reference, compare_greedy, require_model
from tools.server_process import free_port

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land"]
MAX_NEW_TOKENS = 16
NUM_SHARDS = 2
MiB = 2**20
PEAK = 300 * MiB
NON_TORCH = 100 * MiB
TOTALS = {0: 640 * MiB, 1: 520 * MiB}  # rank 1's device is the smaller one


@dataclass
class FixedMemory:
    """A `MemoryGauge` reporting fixed figures: `TOTALS[rank]` bytes on this process's rank,
    `PEAK` during the profile step (its scratch KV pool included), `NON_TORCH` outside torch.
    `calls` records its reads."""

    calls: list[str] = field(default_factory=list)

    def reset_peak(self) -> None:
        self.calls.append("reset_peak")

    def peak_allocated(self) -> int:
        self.calls.append("peak_allocated")
        return PEAK

    def totals(self) -> tuple[int, int]:
        self.calls.append("totals")
        return TOTALS[dist.get_rank()], NON_TORCH


def _generate(engine: LLMEngine, prompts: list[list[int]]) -> list[Reference]:
    """Greedy tokens and their logits rows for every prompt, in one batch."""
    recorder = LogitsRecorder()
    engine.observers.append(recorder)
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for request_id, prompt in zip(tokens, prompts, strict=True):
        engine.add_request(request_id, prompt, params, None, None)
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            tokens[out.request_id] += out.new_token_ids
    engine.observers.remove(recorder)
    return [Reference(ids, recorder.pop(r)[: len(ids)]) for r, ids in tokens.items()]


def test_shards_sized_from_device_memory_start_and_match_one_shard() -> None:
    path = require_model(model_path("tiny-llama-gqa-tied"))
    tokenizer = load_tokenizer(path)
    prompts = [list(tokenizer(p)["input_ids"]) for p in PROMPTS]
    with LLM(path, max_num_tokens=1024) as one:
        ref = _generate(one.engine, prompts)

    memory = FixedMemory()
    config = EngineConfig(
        model_path=path,
        max_num_batched_tokens=256,
        tensor_parallel_size=NUM_SHARDS,
        master_port=free_port(),
        shard_timeout_s=30.0,  # collectives out of step fail the test in 30 s
    )
    engine = build_engine(config, tokenizer, memory=memory)
    try:
        runner = engine.runner
        assert isinstance(runner, LeaderRunner)
        ours = _generate(engine, prompts)
    finally:
        engine.close()

    assert memory.calls == ["reset_peak", "peak_allocated", "totals"]  # rank 0 profiled once
    assert runner.kv_pool_source.startswith(f"memory fraction {config.memory_fraction:g} ")
    assert runner.kv_pool_source.endswith("fewer on another rank: every rank takes the smallest")
    model = LlamaConfig.from_folder(path)
    kv_heads = ShardLayout.of(model, 0, NUM_SHARDS).num_kv_heads
    block_bytes = kv_block_bytes(model, runner.block_size, runner.dtype, kv_heads)
    peak = PEAK - math.ceil(config.max_num_batched_tokens / runner.block_size) * block_bytes
    by_rank = [
        num_blocks_from_memory(
            DeviceMemory(total, peak, NON_TORCH), config.memory_fraction, block_bytes
        )
        for total in TOTALS.values()
    ]
    assert by_rank[1] < by_rank[0] and runner.num_blocks == by_rank[1]  # the smaller rank's
    for ids_ref, ids_ours in zip(ref, ours, strict=True):
        assert ids_ours.token_ids  # generated
        compare_greedy(ids_ours.token_ids, ids_ref, ids_ours.logits)
    assert [r.token_ids for r in ours] == [r.token_ids for r in ref]
