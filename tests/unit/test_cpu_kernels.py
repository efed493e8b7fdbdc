"""The fused C kernels against the same maths in float64 ATen ops."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.cpu import CpuKernels, load_cpu_kernels, load_library
from engine.layers.rotary import RotaryEmbedding
from engine.models.llama import LlamaConfig


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    k = load_cpu_kernels()
    assert k is not None, "the C kernels must build on a machine with a C compiler"
    return k


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()).float()


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("width", [8, 576, 1001])
def test_rms_norm(kernels: CpuKernels, rows: int, width: int) -> None:
    g = torch.Generator().manual_seed(rows * width)
    weight = torch.randn(width, generator=g)
    wide = torch.randn(rows, width + 5, generator=g) * 3
    x = wide[:, :width]  # a row stride other than the width
    torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5))


def test_add_rms_norm_updates_the_residual_in_place(kernels: CpuKernels) -> None:
    g = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(5, 576, generator=g) for _ in range(2))
    weight = torch.randn(576, generator=g)
    expected_sum = x + residual
    out = kernels.add_rms_norm_(x, residual, weight, 1e-6)
    torch.testing.assert_close(residual, expected_sum, rtol=0, atol=0)
    torch.testing.assert_close(out, rms_norm_ref(expected_sum, weight, 1e-6))


def test_silu_and_mul_over_the_whole_float_range(kernels: CpuKernels) -> None:
    gate = torch.cat([torch.linspace(-120, 120, 4001), torch.tensor([0.0, -1e-30, 1e-30])])
    up = torch.randn_like(gate)
    out = kernels.silu_and_mul(torch.cat([gate, up])[None])[0]
    expected = (F.silu(gate.double()) * up.double()).float()
    torch.testing.assert_close(out, expected, rtol=2e-6, atol=1e-30)


@pytest.mark.parametrize(("num_ids", "rows"), [(0, 40), (1, 40), (4, 10), (33, 576)])
def test_gather_columns_matches_index_select(kernels: CpuKernels, num_ids: int, rows: int) -> None:
    g = torch.Generator().manual_seed(num_ids)
    wide = torch.randn(rows, 1003, generator=g)
    wt = wide[:, :1000]  # a row stride other than the width
    ids = torch.randint(0, 1000, (num_ids,), generator=g)
    ids[-1:] = 999  # the last column
    expected = wt.index_select(1, ids).t()  # [N, rows]
    torch.testing.assert_close(kernels.gather_columns(wt, ids), expected, rtol=0, atol=0)


@pytest.mark.parametrize("bad_id", [-1, 1000])
def test_gather_columns_refuses_an_id_outside_the_columns(kernels: CpuKernels, bad_id: int) -> None:
    wt = torch.randn(8, 1000)
    with pytest.raises(IndexError, match="outside"):
        kernels.gather_columns(wt, torch.tensor([3, bad_id]))


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0}])
def test_rope_in_place_matches_rotate(kernels: CpuKernels, scaling: dict | None) -> None:
    heads, head_dim, num_tokens = 5, 64, 7
    config = LlamaConfig.from_dict(
        {
            "vocab_size": 8, "hidden_size": heads * head_dim, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": heads, "rope_theta": 10000.0,
            "rope_scaling": scaling, "max_position_embeddings": 64,
        }
    )  # fmt: skip
    rotary = RotaryEmbedding(config, torch.float32, torch.device("cpu"))
    positions = torch.tensor([0, 1, 63, 200, 5, 5, 1000])  # beyond the table: it grows
    step = rotary.prepare(positions, int(positions.max()), lookup=True)
    assert step.cos_sin is not None
    x = torch.randn(num_tokens, heads * head_dim + 3)  # 3 trailing values the kernel leaves
    expected = rotary.rotate(x[:, : heads * head_dim].reshape(num_tokens, heads, head_dim),
                             step.cos_sin)  # fmt: skip
    tail = x[:, heads * head_dim :].clone()
    kernels.rope_(x, heads, head_dim, rotary.table, positions)
    rotated = x[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    torch.testing.assert_close(rotated, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(x[:, heads * head_dim :], tail)
    # The rotation preserves each head's norm (a check independent of `rotate`).
    assert math.isclose(rotated.norm().item(), expected.norm().item(), rel_tol=1e-5)


@pytest.mark.parametrize(("groups", "siblings", "width"), [(1, 1, 576), (5, 3, 576), (3, 2, 37)])
def test_speculator_stage_matches_the_float64_stage(
    kernels: CpuKernels, groups: int, siblings: int, width: int
) -> None:
    g = torch.Generator().manual_seed(groups * siblings * width)
    emb = torch.randn(50, width, generator=g)
    wide = torch.randn(groups, width + 3, generator=g) * 2
    projected = wide[:, :width]  # a row stride other than the width
    token_ids = torch.randint(0, 50, (groups, siblings), generator=g)
    ln_weight, ln_bias = torch.randn(width, generator=g), torch.randn(width, generator=g)
    out = kernels.speculator_stage(projected, token_ids, emb, 1.7, ln_weight, ln_bias, 1e-6)
    h = emb.double()[token_ids] * 1.7 + projected.double()[:, None]  # [G, c, d]
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * ln_weight.double()
    expected = F.gelu(h + ln_bias.double()).flatten(0, 1)  # erf's GELU
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=5e-7)


def test_gelu_of_the_stage_over_the_whole_float_range(kernels: CpuKernels) -> None:
    x = torch.cat([torch.linspace(-30, 30, 6001), torch.tensor([0.0, -1e-30, 1e-30, 1e4, -1e4])])
    width = x.numel()
    # one token whose embedding is x, no projection, and a norm that undoes itself
    rms = float(x.double().pow(2).mean().sqrt())
    out = kernels.speculator_stage(
        torch.zeros(1, width), torch.zeros(1, 1, dtype=torch.int64), x[None].clone(), 1.0,
        torch.full((width,), rms), torch.zeros(width), 0.0,
    )[0]  # fmt: skip
    torch.testing.assert_close(out.double(), F.gelu(x.double()), rtol=1e-5, atol=3e-7)


@pytest.mark.parametrize(("rows", "vocab", "k"), [(1, 4096, 5), (15, 4096, 2), (4, 100, 7)])
def test_log_softmax_topk_matches_aten(kernels: CpuKernels, rows: int, vocab: int, k: int) -> None:
    g = torch.Generator().manual_seed(rows * vocab + k)
    logits = torch.randn(rows, vocab, generator=g) * 4
    logits[0, 10] = logits[0, 90] = logits[0].max() + 1  # a tie at the top: lower column first
    top, ids = kernels.log_softmax_topk(logits, k)
    ref_top, _ = logits.double().log_softmax(-1).topk(k, dim=-1)
    torch.testing.assert_close(top.double(), ref_top, rtol=0, atol=2e-6)
    assert ids[0, :2].tolist() == [10, 90]
    assert torch.equal(logits.gather(1, ids), logits.topk(k, dim=-1).values)
    columns = torch.randperm(50_000, generator=g)[:vocab]  # a draft vocabulary's token ids
    mapped_top, mapped = kernels.log_softmax_topk(logits, k, columns)
    assert torch.equal(mapped_top, top) and torch.equal(mapped, columns[ids])


def test_a_library_is_rebuilt_when_a_header_beside_its_sources_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The on-disk cache key covers every source and the headers they may include."""
    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path / "home"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.c").write_text('#include "value.h"\nint a_value(void) { return VALUE; }\n')
    (src / "b.c").write_text('#include "value.h"\nint b_value(void) { return 10 * VALUE; }\n')
    build = load_library.__wrapped__  # past the per-process cache
    values = []
    for value in (1, 2):
        (src / "value.h").write_text(f"#define VALUE {value}\n")
        lib = build((src / "a.c", src / "b.c"))
        values.append((lib.a_value(), lib.b_value()))
    assert values == [(1, 10), (2, 20)]
    assert len(list((tmp_path / "home" / "kernels").glob("a-*.so"))) == 2
