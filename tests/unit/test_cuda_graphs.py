"""Decode and draft-tree steps through `StepGraphs`' static buffers against the ordinary eager
step.

On CPU the graphs are not captured: the same static-buffer step (one int32 buffer per bucket,
padding rows written to the pad block, outputs sliced from the bucket) runs eagerly, on the
Triton kernel under the interpreter (tests/conftest.py sets TRITON_INTERPRET=1). The oracle is
the same model on the same Triton backend without graphs: every chosen token's logits, the
tokens and the K/V the real blocks hold must agree; the pad block is one block past the pool the
KV manager knows.
"""

from __future__ import annotations

import pytest
import torch

from engine.attention.triton_backend import TritonBackend
from engine.config import EngineConfig, SchedulerConfig
from engine.core import LLMEngine
from engine.cuda_graphs import MAX_TREE_ROWS, GraphSequence, StepGraphs
from engine.hooks import LogitsRecorder
from engine.model_runner import ModelRunner
from engine.paths import model_path
from engine.sampling.params import SamplingParams
from engine.spec_decode.drafter import Drafter
from engine.spec_decode.tree import DraftTree
from engine.step_io import ModelOutput, SequenceInput
from tests.reference import chat_prompt_ids
from tools.scripted_proposer import ScriptedProposer

MODEL = "tiny-llama-gqa-tied"
BLOCK_SIZE = 4


def triton_runner(
    monkeypatch: pytest.MonkeyPatch, cuda_graphs: bool, max_num_seqs: int, max_rows: int = 4
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
        cuda_graph_max_rows=max_rows,
    )
    return ModelRunner(config)


def generate(
    runner: ModelRunner,
    prompts: list[list[int]],
    max_new_tokens: list[int],
    drafter: Drafter | None = None,
) -> tuple[dict[str, list[int]], LogitsRecorder]:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=128)
    engine = LLMEngine(runner, config, frozenset(), drafter)
    recorder = LogitsRecorder()
    engine.observers.append(recorder)
    tokens: dict[str, list[int]] = {}
    for i, (prompt, n) in enumerate(zip(prompts, max_new_tokens, strict=True)):
        engine.add_request(str(i), prompt, SamplingParams(max_new_tokens=n))
        tokens[str(i)] = []
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            tokens[out.request_id] += out.new_token_ids
    return tokens, recorder


def counted_buckets(monkeypatch: pytest.MonkeyPatch, graphs: StepGraphs) -> list[tuple[int, int]]:
    """(rows, bucket) of every step the graphs run from now on."""
    runs: list[tuple[int, int]] = []
    run = graphs.run

    def counted_run(seqs: list[GraphSequence]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = sum(len(s.token_ids) for s in seqs)
        runs.append((rows, graphs.bucket(rows) or 0))
        return run(seqs)

    monkeypatch.setattr(graphs, "run", counted_run)
    return runs


def assert_same_run(
    graphed: ModelRunner,
    eager: ModelRunner,
    results: tuple[dict[str, list[int]], LogitsRecorder],
    ref_results: tuple[dict[str, list[int]], LogitsRecorder],
) -> None:
    """Same tokens, every chosen token's logits within 1e-4, the same K/V in the real blocks."""
    (tokens, logits), (ref_tokens, ref_logits) = results, ref_results
    assert tokens == ref_tokens
    for request_id in tokens:
        for ours, ref in zip(logits.pop(request_id), ref_logits.pop(request_id), strict=True):
            torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    assert graphed.graphs is not None
    pad = graphed.graphs.pad_block
    for ours_layer, ref_layer in zip(graphed.kv_caches, eager.kv_caches, strict=True):
        for a, b in zip(ours_layer, ref_layer, strict=True):
            torch.testing.assert_close(a[:pad], b, atol=1e-4, rtol=1e-4)


def short_prompts() -> list[list[int]]:
    return [
        list(p)[:n] for p, n in zip(chat_prompt_ids(model_path(MODEL)), (9, 14, 5), strict=False)
    ]


def test_decode_graphs_equal_the_eager_step(monkeypatch: pytest.MonkeyPatch) -> None:
    max_new_tokens = [6, 3, 8]  # batches of 3, 2 and 1 sequences: buckets 4 (padded), 2, 1
    eager = triton_runner(monkeypatch, cuda_graphs=False, max_num_seqs=4)
    graphed = triton_runner(monkeypatch, cuda_graphs=True, max_num_seqs=4)
    assert eager.graphs is None and graphed.graphs is not None
    assert graphed.graphs.row_counts == [1, 2, 4]
    assert graphed.kv_caches[0][0].shape[0] == graphed.num_blocks + 1 == 65
    runs = counted_buckets(monkeypatch, graphed.graphs)
    ref = generate(eager, short_prompts(), max_new_tokens)
    ours = generate(graphed, short_prompts(), max_new_tokens)
    assert sorted(set(runs)) == [(1, 1), (2, 2), (3, 4)]
    assert_same_run(graphed, eager, ours, ref)


def test_draft_tree_graphs_equal_the_eager_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Speculative steps (trees of up to 7 rows, alone or beside decode rows) run as graphs of
    up to 16 rows, padded; larger ones eagerly. Drafts come from the greedy sequences with
    known errors, so trees are partly accepted and partly rejected."""
    prompts, max_new_tokens = short_prompts(), [12, 6, 16]
    eager = triton_runner(monkeypatch, cuda_graphs=False, max_num_seqs=4)
    plain, _ = generate(eager, prompts, max_new_tokens)
    sequences = [prompts[int(i)] + tokens for i, tokens in plain.items()]

    def drafter() -> Drafter:
        proposer = ScriptedProposer(
            sequences, [2, 0, 3, 1], 3, n_candidates=2, vocab_size=eager.config.vocab_size
        )
        return Drafter(proposer, None, max_batch_size=4)

    eager = triton_runner(monkeypatch, cuda_graphs=False, max_num_seqs=4)
    graphed = triton_runner(monkeypatch, cuda_graphs=True, max_num_seqs=4, max_rows=16)
    assert graphed.graphs is not None and graphed.graphs.row_counts == [1, 2, 4, 8, 16]
    runs = counted_buckets(monkeypatch, graphed.graphs)
    eager_steps: list[int] = []
    execute = graphed.execute

    def counted_execute(seqs: list[SequenceInput]) -> ModelOutput:
        before = len(runs)
        out = execute(seqs)
        if len(runs) == before:
            eager_steps.append(sum(len(s.token_ids) for s in seqs))
        return out

    monkeypatch.setattr(graphed, "execute", counted_execute)
    ref = generate(eager, prompts, max_new_tokens, drafter())
    ours = generate(graphed, prompts, max_new_tokens, drafter())
    assert ours[0] == plain
    tree_runs = [(rows, bucket) for rows, bucket in runs if rows > 1]
    assert any(rows < bucket for rows, bucket in tree_runs)  # padded speculative steps
    assert {bucket for _, bucket in tree_runs} >= {4, 8}
    assert any(rows > 16 for rows in eager_steps)  # three trees: beyond the largest graph
    assert_same_run(graphed, eager, ours, ref)


def test_steps_the_graphs_do_not_cover_run_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = triton_runner(monkeypatch, cuda_graphs=True, max_num_seqs=2)
    assert runner.graphs is not None and runner.graphs.row_counts == [1, 2, 4]
    table = list(range(4))
    decode = SequenceInput([5], 3, table)
    mask = torch.ones(2, 2).bool().tril()
    tree = SequenceInput([5, 6], 2, table, [2, 3], mask, logits_indices=[0, 1])
    assert runner._graph_step([decode, decode]) is not None
    assert runner._graph_step([decode, tree]) is not None
    assert runner._graph_step([tree, tree, decode]) is None  # 5 rows > 4
    assert runner._graph_step([SequenceInput([5, 6], 2, table, logits_indices=[0, 1])]) is None
    assert runner._graph_step([SequenceInput([5], 3, table, logits_indices=[])]) is None
    prefix = SequenceInput([5], 0, table, prefix_embeds=torch.zeros(1, 64))
    assert runner._graph_step([prefix]) is None
    assert runner._graph_step([SequenceInput([5], 3, list(range(33)))]) is None  # 33 > 128 / 4

    wide = triton_runner(monkeypatch, cuda_graphs=True, max_num_seqs=2, max_rows=128)

    def chain(n: int) -> SequenceInput:
        mask = torch.ones(n, n).bool().tril()
        return SequenceInput([5] * n, 0, list(range(32)), list(range(n)), mask, list(range(n)))

    assert wide._graph_step([chain(MAX_TREE_ROWS)]) is not None
    assert wide._graph_step([chain(MAX_TREE_ROWS + 1)]) is None


def test_graph_outputs_are_only_the_real_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tree of four nodes and a decode row run at bucket 8; the outputs hold five rows, and
    the three padding rows wrote only to the pad block."""
    runner = triton_runner(monkeypatch, cuda_graphs=True, max_num_seqs=4, max_rows=8)
    graphs = runner.graphs
    assert graphs is not None
    tree = DraftTree.from_paths([[11, 12], [13]])
    seqs = [
        SequenceInput([7], 0, [0]),
        SequenceInput(
            [8, *tree.token_ids],
            2,
            [1, 2],
            positions=[2 + d for d in tree.depths],
            tree_mask=tree.attention_mask(),
            logits_indices=list(range(4)),
        ),
    ]
    before = [c.clone() for layer in runner.kv_caches for c in layer]
    runs = counted_buckets(monkeypatch, graphs)
    out = runner.execute(seqs)
    assert runs == [(5, 8)]
    assert out.logits.shape == (5, runner.config.vocab_size) and out.num_rows == [1, 4]
    after = [c for layer in runner.kv_caches for c in layer]
    for a, b in zip(after, before, strict=True):
        changed = (a != b).flatten(1).any(1).nonzero().flatten().tolist()
        assert changed == [0, 1, 2, graphs.pad_block]
    eager = triton_runner(monkeypatch, cuda_graphs=False, max_num_seqs=4)
    ref = eager.execute(seqs)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.hidden_states, ref.hidden_states, atol=1e-4, rtol=1e-4)
