"""bfloat16 on CPU: the feature check and its start-up warning, the oneDNN kernel against a
float64 product, and greedy output against transformers in bfloat16."""

from __future__ import annotations

import logging
from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM
from engine.kernels import cpu, matmul
from engine.layers.linear import Linear
from tests.reference import chat_prompt_ids, model_greedy

MAX_NEW = 16
BF16_ULPS = 8
"""Logits agree within this many bfloat16 ulps at the top logit's magnitude (2^-7 relative
each: its 8-bit significand rounds every product, norm and residual sum of each layer, in a
different order in each implementation), and a near-tie is a gap smaller than that."""


def bf16_tolerance(logits: torch.Tensor) -> float:
    top = logits.abs().max().item()
    return BF16_ULPS * 2.0 ** (int(torch.tensor(top).log2().floor().item()) - 7)


needs_native_bf16 = pytest.mark.skipif(
    not matmul._onednn_bf16_available(), reason="no AVX512_BF16 / AMX-BF16 or no oneDNN linear"
)


def fake_flags(monkeypatch: pytest.MonkeyPatch, flags: set[str]) -> None:
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset(flags))


def test_cpu_flags_are_this_cpus() -> None:
    """cpu_flags() is the `flags` line of /proc/cpuinfo (Linux), split into names."""
    info = Path("/proc/cpuinfo")
    if not info.is_file():
        pytest.skip("no /proc/cpuinfo")
    line = next(ln for ln in info.read_text().splitlines() if ln.startswith("flags"))
    assert cpu.cpu_flags() == frozenset(line.split(":", 1)[1].split())
    assert "fpu" in cpu.cpu_flags()


@pytest.mark.parametrize(
    ("flags", "native"),
    [
        ({"avx2", "avx512f"}, False),  # Zen 3, Ice Lake: no bfloat16 instructions
        (set(), False),
        ({"avx512f", "avx512_bf16"}, True),  # Zen 4, Cooper Lake
        ({"avx512f", "amx_bf16", "amx_tile"}, True),
    ],
)
def test_bf16_warning_follows_the_flags(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    flags: set[str],
    native: bool,
) -> None:
    fake_flags(monkeypatch, flags)
    with caplog.at_level(logging.INFO, logger=cpu.__name__):
        assert cpu.check_cpu_bf16() is native
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if native:
        assert warnings == []
    else:
        assert len(warnings) == 1 and "AVX512_BF16" in warnings[0] and "float32" in warnings[0]


def test_bf16_model_warns_at_start_up_without_bf16_instructions(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tiny_path: Path
) -> None:
    fake_flags(monkeypatch, {"avx2"})
    with caplog.at_level(logging.WARNING):
        LLM(tiny_path, dtype="bfloat16")
        LLM(tiny_path, dtype="float32")
    warnings = [r.getMessage() for r in caplog.records if "AVX512_BF16" in r.getMessage()]
    assert len(warnings) == 1  # the bfloat16 model's, not the float32 one's


@needs_native_bf16
def test_bf16_layers_default_to_onednn() -> None:
    layer = Linear(96, 160, dtype=torch.bfloat16, device="cpu")
    assert set(layer.kernel_names.values()) == {"onednn"}


@needs_native_bf16
@pytest.mark.parametrize("kernel", ["onednn", "onednn-serial"])
@pytest.mark.parametrize("gated", [False, True])
def test_onednn_kernels_match_a_float64_product(kernel: str, gated: bool) -> None:
    """Every M, with bias, before and after the weights change (the packed copy follows); the
    serial kernel leaves torch's thread count as it found it."""
    k, n = 96, 160
    threads = torch.get_num_threads()
    layer = Linear(k, n, bias=True, dtype=torch.bfloat16, device="cpu", gated=gated)
    layer.install({1: (kernel, matmul.KERNELS[kernel].build(layer, {}))})
    for _ in range(2):
        layer.load_rows(0, torch.randn(n, k))
        layer.load_bias(0, torch.randn(n))
        w, b = layer.weight_view().double(), layer.bias.double()
        for m in (1, 2, 7, 16, 33, 64, 65, 200):
            x = torch.randn(m, k).bfloat16()
            y = layer(x)
            assert y.dtype == torch.bfloat16 and y.shape == (m, n)
            ref = x.double() @ w.t() + b
            # float32 accumulation, one rounding to bfloat16 (relative 2^-9) at the end
            torch.testing.assert_close(y.double(), ref, rtol=2.0**-8, atol=1e-3 * k**0.5)
            assert torch.get_num_threads() == threads


@cache
def hf_bf16_greedy(path: Path, prompt: tuple[int, ...]) -> tuple[list[int], list[torch.Tensor]]:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    ref = model_greedy(model, prompt, MAX_NEW)
    return ref.token_ids, ref.logits


@needs_native_bf16
def test_bf16_greedy_matches_transformers_bf16(tiny_path: Path) -> None:
    """Token for token, except after a near-tie of transformers' bfloat16 logits
    (`BF16_ULPS`), where ours must be one of the tied; logits within `BF16_ULPS` up to there."""
    llm = LLM(tiny_path, dtype="bfloat16")
    prompts = [list(p) for p in chat_prompt_ids(tiny_path)[:4]]
    outputs = llm.generate(prompts, MAX_NEW, return_logits=True)
    for prompt, ours in zip(prompts, outputs, strict=True):
        ref, logits = hf_bf16_greedy(tiny_path, tuple(prompt))
        tokens = ours.token_ids
        diff = next((i for i, (a, b) in enumerate(zip(tokens, ref, strict=False)) if a != b), None)
        for i in range(len(tokens) if diff is None else diff + 1):
            err = (ours.logits[i].float() - logits[i]).abs().max().item()
            assert err <= bf16_tolerance(logits[i]), f"logits at step {i} differ by {err}"
        if diff is None:
            assert len(tokens) == len(ref)
            continue
        gap = (logits[diff].max() - logits[diff][tokens[diff]]).item()
        assert gap <= bf16_tolerance(logits[diff]), f"token {diff} differs at a gap of {gap:.3g}"
