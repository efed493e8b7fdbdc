"""Split-KV (flash-decoding) attention against the torch backend, under Triton's interpreter.

The split path serves every kind of row (decode, prefill chunks, draft trees): each program's
keys are cut into contiguous ranges and the partial results merged by their log-sum-exps. Here
a backend told that the device has many multiprocessors and that a split may be as short as one
key tile takes it on small contexts; every case checks that the launch did split, and how many
ways, so that a case cannot pass on the unsplit kernel.
"""

from __future__ import annotations

import pytest
import torch

from engine.attention.triton_backend import (
    BLOCK_N,
    MAX_KV_SPLITS,
    MIN_SPLIT_KEYS,
    TritonBackend,
    num_kv_splits,
)
from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.paths import model_path
from engine.spec_decode.tree import DraftTree
from engine.step_io import SequenceInput
from tests.unit.test_triton_attention import (
    DEVICE,
    HEAD_SHAPES,
    INTERPRETED,
    SHAPE_IDS,
    Seq,
    chain,
    random_tree,
    run_case,
    widths_tree,
)


def split_backend(
    monkeypatch: pytest.MonkeyPatch, block_size: int, num_sms: int = 64
) -> tuple[TritonBackend, list[int]]:
    """A backend that splits small contexts (one key tile per split at least), and the split
    counts of its launches."""
    backend = TritonBackend(block_size, num_sms=num_sms, min_split_keys=BLOCK_N)
    splits: list[int] = []
    attend = backend.attend

    def recorded(*args: object) -> torch.Tensor:
        splits.append(args[-1])  # type: ignore[arg-type]
        return attend(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(backend, "attend", recorded)
    return backend, splits


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("head_shape", HEAD_SHAPES, ids=SHAPE_IDS)
def test_split_decode(
    monkeypatch: pytest.MonkeyPatch, head_shape: tuple[int, int, int], block_size: int
) -> None:
    """Decode rows of sequences of different lengths: splits of two key tiles, some empty for
    the shorter sequences, ranges starting inside and on block boundaries."""
    seqs = [Seq(200, 1), Seq(95, 1), Seq(0, 1), Seq(64, 1), Seq(131, 1)]
    backend, splits = split_backend(monkeypatch, block_size)
    out_err, cache_err = run_case(seqs, head_shape, block_size, backend=backend)
    programs = len(seqs) * head_shape[1]
    assert splits == [min(-(-64 // programs), 201 // BLOCK_N)] and splits[0] > 1
    assert out_err <= 1e-5, out_err
    assert cache_err == 0.0


@pytest.mark.parametrize("head_shape", HEAD_SHAPES[:2], ids=SHAPE_IDS[:2])
def test_split_mixed_step(
    monkeypatch: pytest.MonkeyPatch, head_shape: tuple[int, int, int]
) -> None:
    """Trees, prefill chunks and decode rows in one split launch: 4 splits of 64 keys for the
    longest sequence, whose tree's new tokens span two splits and whose context ends inside
    one; causal chunks longer than a program's rows, whose programs see different key counts."""
    seqs = [
        Seq(9, 1),
        Seq(40, 10, widths_tree([3, 2])),
        Seq(0, 20),
        Seq(100, 33, random_tree(33, seed=4)),
        Seq(33, 6, chain(6)),
    ]
    backend, splits = split_backend(monkeypatch, 4, num_sms=10_000)
    out_err, cache_err = run_case(seqs, head_shape, 4, backend=backend)
    assert splits == [min(MAX_KV_SPLITS, 133 // BLOCK_N)] == [4]
    assert out_err <= 1e-5, out_err
    assert cache_err == 0.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_split_half_precision(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """Half-precision inputs: the partials and their merge stay in fp32, one rounding at the
    end, as in the unsplit kernel."""
    seqs = [Seq(150, 1), Seq(40, 10, widths_tree([3, 2])), Seq(77, 1)]
    backend, splits = split_backend(monkeypatch, 16)
    out_err, cache_err = run_case(seqs, HEAD_SHAPES[1], 16, dtype=dtype, backend=backend)
    assert splits[0] > 1
    assert out_err <= 4 * torch.finfo(dtype).eps, out_err
    assert cache_err == 0.0


def test_split_rule() -> None:
    """Split when the grid leaves multiprocessors idle, into about one wave of programs, at most
    `MAX_KV_SPLITS`, each at least `MIN_SPLIT_KEYS` keys; a graph's step (lengths unknown)
    by its program count alone."""
    sms = 132
    # One decode row of 40 KV heads (13B, MHA): 40 programs fill 160 slots in 4 splits.
    assert num_kv_splits(40, 4096, sms, MIN_SPLIT_KEYS) == 4
    assert num_kv_splits(40, 700, sms, MIN_SPLIT_KEYS) == 2  # 700 keys: 2 splits of >= 256
    assert num_kv_splits(40, 511, sms, MIN_SPLIT_KEYS) == 1  # too short to split
    assert num_kv_splits(40, None, sms, MIN_SPLIT_KEYS) == 4  # a graph's step
    # GQA with 8 KV heads: 8 programs; 16 splits at most.
    assert num_kv_splits(8, 8192, sms, MIN_SPLIT_KEYS) == MAX_KV_SPLITS
    # Grids that already fill the device never split.
    assert num_kv_splits(132, 32768, sms, MIN_SPLIT_KEYS) == 1
    assert num_kv_splits(160, None, sms, MIN_SPLIT_KEYS) == 1
    assert num_kv_splits(1, 10**6, 1, MIN_SPLIT_KEYS) == 1  # off CUDA: one "SM"


def test_split_graph_step_equals_unsplit_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA-graph step (captured on CUDA; its static buffers run eagerly off CUDA) takes its
    split count from
    its row count alone: a tree and a decode row after prompts of 70 and 41 tokens, at bucket
    8, split 4 ways, give the logits and hidden states of the unsplit eager step."""

    def runner(backend: TritonBackend, graphs: bool) -> ModelRunner:
        monkeypatch.setattr("engine.model_runner.select_backend", lambda *args: backend)
        config = EngineConfig(
            model_path("tiny-llama-gqa-tied"),
            device=DEVICE,
            dtype="float32",
            block_size=16,
            num_kv_blocks=16,
            max_num_seqs=4,
            max_model_len=128,
            cpu_kernels=False,
            cuda_graphs=graphs,
            cuda_graph_max_rows=8,
        )
        return ModelRunner(config)

    tree = DraftTree.from_paths([[11, 12], [13]])
    prompts = [[(5 * j) % 300 + 3 for j in range(70)], [(3 * j) % 200 + 7 for j in range(41)]]
    tables = [[0, 1, 2, 3, 4], [5, 6, 7]]
    step = [
        SequenceInput(
            [8, *tree.token_ids],
            70,
            tables[0],
            positions=[70 + d for d in tree.depths],
            tree_mask=tree.attention_mask(),
            logits_indices=list(range(4)),
        ),
        SequenceInput([9], 41, tables[1]),
    ]
    outputs = []
    split, splits = split_backend(monkeypatch, 16, num_sms=8)
    for r in (runner(TritonBackend(16), graphs=False), runner(split, graphs=True)):
        r.execute([SequenceInput(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
        splits.clear()
        out = r.execute(step)
        outputs.append((out.logits.clone(), out.hidden_states.clone()))
    if INTERPRETED:  # on CUDA the step replays its graph, captured at start-up
        assert splits == [4, 4]  # both layers: 2 KV heads x 1 query block, 8 "SMs"
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-4, rtol=1e-4)
