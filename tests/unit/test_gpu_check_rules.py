"""The GPU check's verdicts (bench/gpu_check), on made-up figures: a difference between two runs
passes only at a near-tie of the reference's logits; the batch speed-up it demands follows
from the bytes a step moves; an interpreter or library too old is named before anything runs.
The dry run of the whole check is tests/server/test_gpu_check.py."""

from __future__ import annotations

import sys

import pytest
import torch

from bench.gpu_check import versions
from bench.gpu_check.models import Reference, judge
from bench.gpu_check.report import FP16_NEAR_TIE
from bench.gpu_check.speed import ideal_speedup


def _reference(tokens: list[int], gap_at_2: float) -> Reference:
    """Logits over 8 tokens choosing `tokens`; at position 2 token 5 is second by `gap_at_2`."""
    logits = []
    for i, t in enumerate(tokens):
        row = torch.zeros(8)
        row[t] = 10.0
        if i == 2:
            row[5] = 10.0 - gap_at_2
        logits.append(row)
    return Reference(tokens, logits)


def test_a_difference_passes_only_at_a_near_tie() -> None:
    eager = [3, 4, 6, 7]
    assert judge(eager, _reference(eager, 1.0), FP16_NEAR_TIE) == ("same", None)
    flipped = [3, 4, 5, 1]  # differs at 2 where token 5 is the reference's runner-up
    assert judge(flipped, _reference(eager, 0.01), FP16_NEAR_TIE)[0] == "flip"
    assert judge(flipped, _reference(eager, 0.5), FP16_NEAR_TIE)[0] == "bad"  # no near-tie
    other = [3, 4, 2, 7]  # a token outside the top 2
    assert judge(other, _reference(eager, 0.01), FP16_NEAR_TIE)[0] == "bad"
    assert judge(eager[:3], _reference(eager, 0.01), FP16_NEAR_TIE)[0] == "bad"  # shorter


def test_batch_speedup_follows_the_bytes_moved() -> None:
    """Llama-2-13B in fp16 at context 512: 25.7 GB of weights, 800 KiB of K/V per token; batch
    32 reads 13.4 GB of K/V besides, so at best about 21x batch 1's tokens per second."""
    weights, kv_token = int(25.7e9), 800 * 1024
    ideal = ideal_speedup(32, 512, weights, kv_token)
    assert 32 * 512 * kv_token == pytest.approx(13.4e9, rel=0.01)
    assert 21.0 < ideal < 21.6
    assert ideal_speedup(1, 512, weights, kv_token) == 1.0
    assert ideal_speedup(32, 0, weights, kv_token) == 32.0  # no context: weights only


def test_old_interpreter_and_libraries_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    assert versions.problems("cpu") == []  # this environment is supported
    monkeypatch.setattr(versions, "MIN_PYTHON", (sys.version_info[0], sys.version_info[1] + 1))
    monkeypatch.setattr(versions, "MIN_TORCH", (99, 0))
    found = versions.problems("cpu")
    assert len(found) == 2
    assert found[0].startswith(f"Python {versions.MIN_PYTHON[0]}.{versions.MIN_PYTHON[1]} ")
    assert found[1] == f"torch {torch.__version__} is older than 99.0"
    with pytest.raises(SystemExit) as exit_info:
        versions.check_versions("cpu")
    assert exit_info.value.code == 2
    assert versions.device_of(["--small", "--device", "cpu"]) == "cpu"
    assert versions.device_of(["--device=cuda"]) == "cuda"
    assert versions.device_of([]) == "cuda"
