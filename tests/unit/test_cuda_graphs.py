"""Decode steps through `DecodeGraphs`' static buffers against the ordinary eager step.

On CPU the graphs are not captured: the same static-buffer step (one [B, 4 + max_blocks] input
matrix, padding rows written to the pad block, outputs sliced from the bucket) runs eagerly, on
the Triton kernel under the interpreter (tests/conftest.py sets TRITON_INTERPRET=1). The oracle
is the same model on the same Triton backend without graphs: every chosen token's logits, the
tokens and the K/V the real blocks hold must agree; the pad block is one block past the pool
the KV manager knows.
"""

from __future__ import annotations

import pytest
import torch

from engine.attention.triton_backend import TritonBackend
from engine.config import EngineConfig, SchedulerConfig
from engine.core import LLMEngine
from engine.cuda_graphs import DecodeRow
from engine.hooks import LogitsRecorder
from engine.model_runner import ModelRunner, SequenceInput
from engine.paths import model_path
from engine.sampling.params import SamplingParams
from tests.reference import chat_prompt_ids

MODEL = "tiny-llama-gqa-tied"
BLOCK_SIZE = 4


def triton_runner(
    monkeypatch: pytest.MonkeyPatch, cuda_graphs: bool, max_num_seqs: int
) -> ModelRunner:
    monkeypatch.setattr(
        "engine.model_runner.select_backend", lambda *args: TritonBackend(BLOCK_SIZE)
    )
    config = EngineConfig(
        model_path(MODEL),
        dtype="float32",
        block_size=BLOCK_SIZE,
        num_kv_blocks=64,
        max_num_seqs=max_num_seqs,
        max_model_len=128,
        cpu_kernels=False,
        cuda_graphs=cuda_graphs,
    )
    return ModelRunner(config)


def generate(
    runner: ModelRunner, prompts: list[list[int]], max_new_tokens: list[int]
) -> tuple[dict[str, list[int]], LogitsRecorder]:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=128)
    engine = LLMEngine(runner, config, frozenset())
    recorder = LogitsRecorder()
    engine.observers.append(recorder)
    tokens: dict[str, list[int]] = {}
    for i, (prompt, n) in enumerate(zip(prompts, max_new_tokens, strict=True)):
        engine.add_request(str(i), prompt, SamplingParams(max_new_tokens=n))
        tokens[str(i)] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return tokens, recorder


def test_decode_graphs_equal_the_eager_step(monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = [
        list(p)[:n] for p, n in zip(chat_prompt_ids(model_path(MODEL)), (9, 14, 5), strict=False)
    ]
    max_new_tokens = [6, 3, 8]  # batches of 3, 2 and 1 sequences: buckets 4 (padded), 2, 1
    eager = triton_runner(monkeypatch, cuda_graphs=False, max_num_seqs=4)
    graphed = triton_runner(monkeypatch, cuda_graphs=True, max_num_seqs=4)
    assert eager.graphs is None and graphed.graphs is not None
    assert graphed.graphs.batch_sizes == [1, 2, 4]
    assert graphed.kv_caches[0][0].shape[0] == graphed.num_blocks + 1 == 65

    graphs = graphed.graphs
    buckets: list[int | None] = []
    run = graphs.run

    def counted_run(rows: list[DecodeRow]) -> tuple[torch.Tensor, torch.Tensor]:
        buckets.append(graphs.bucket(len(rows)))
        return run(rows)

    monkeypatch.setattr(graphs, "run", counted_run)
    ref_tokens, ref_logits = generate(eager, prompts, max_new_tokens)
    tokens, logits = generate(graphed, prompts, max_new_tokens)
    assert sorted(set(buckets)) == [1, 2, 4]
    assert tokens == ref_tokens
    for request_id in tokens:
        for ours, ref in zip(logits.pop(request_id), ref_logits.pop(request_id), strict=True):
            torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    pad = graphs.pad_block
    for ours, ref in zip(graphed.kv_caches, eager.kv_caches, strict=True):
        for a, b in zip(ours, ref, strict=True):
            torch.testing.assert_close(a[:pad], b, atol=1e-4, rtol=1e-4)


def test_steps_the_graphs_do_not_cover_run_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = triton_runner(monkeypatch, cuda_graphs=True, max_num_seqs=2)
    assert runner.graphs is not None and runner.graphs.batch_sizes == [1, 2]
    table = list(range(4))
    decode = SequenceInput([5], 3, table)
    assert runner._is_graph_step([decode, decode])
    assert not runner._is_graph_step([decode] * 3)  # beyond the largest bucket
    assert not runner._is_graph_step([SequenceInput([5, 6], 2, table)])  # a chunk
    assert not runner._is_graph_step([SequenceInput([5], 3, table, logits_indices=[])])
    tree = SequenceInput([5, 6], 2, table, positions=[2, 3], tree_mask=torch.ones(2, 2).bool())
    assert not runner._is_graph_step([decode, tree])
    assert not runner._is_graph_step([SequenceInput([5], 3, list(range(33)))])  # 33 > 128 / 4


def test_graph_outputs_are_only_the_real_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of three runs at bucket 4; the outputs hold three rows, and the padding row
    wrote only to the pad block."""
    runner = triton_runner(monkeypatch, cuda_graphs=True, max_num_seqs=4)
    graphs = runner.graphs
    assert graphs is not None
    for cache in (c for layer in runner.kv_caches for c in layer):
        cache[graphs.pad_block].zero_()  # the capture's own padding rows wrote there
    before = [c.clone() for layer in runner.kv_caches for c in layer]
    seqs = [SequenceInput([7 + i], 0, [i]) for i in range(3)]
    out = runner.execute(seqs)
    assert out.logits.shape == (3, runner.config.vocab_size) and out.num_rows == [1, 1, 1]
    after = [c for layer in runner.kv_caches for c in layer]
    for a, b in zip(after, before, strict=True):
        changed = (a != b).flatten(1).any(1).nonzero().flatten().tolist()
        assert changed == [0, 1, 2, graphs.pad_block]
    eager = triton_runner(monkeypatch, cuda_graphs=False, max_num_seqs=4)
    ref = eager.execute(seqs)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.hidden_states, ref.hidden_states, atol=1e-4, rtol=1e-4)
