"""The quantized-weight contract (engine/quant): nibble packing and dequantization round trips,
the reference product against float arithmetic on the dequantized weight, int8 quantization at
load against numpy, GPTQ group orders, and the kernel `quant_kernel` chooses against the
reference for each device rule (any correct kernel passes: float32 rounding apart)."""

from __future__ import annotations

import pytest
import torch

from engine.layers.quant_linear import QuantLinear
from engine.quant.gptq import group_order
from engine.quant.kernels import int8_activations, quant_kernel
from engine.quant.reference import activation_group, quantize_rows, reference_linear
from engine.quant.scheme import QuantScheme
from engine.quant.weights import QuantizedWeight, pack_int4
from tests.quant_reference import int8_dequantize


def _weight(bits: int, group: int, zeros: bool, perm: bool, seed: int = 0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    out, n = 24, 96
    lo, hi = (-8, 8) if bits == 4 else (-128, 128)
    q = torch.randint(lo, hi, (out, n), generator=g, dtype=torch.int8)
    groups = n // group
    return QuantizedWeight(
        bits=bits,
        group_size=group,
        qweight=pack_int4(q) if bits == 4 else q,
        scales=torch.rand(out, groups, generator=g) * 0.01 + 1e-3,
        zeros=torch.randint(-3, 4, (out, groups), generator=g, dtype=torch.int8) if zeros else None,
        perm=torch.randperm(n, generator=g) if perm else None,
    )


def test_pack_int4_round_trips() -> None:
    q = torch.randint(-8, 8, (5, 12), dtype=torch.int8)
    w = QuantizedWeight(4, 12, pack_int4(q), torch.ones(5, 1), None, None)
    assert torch.equal(w.int_values(), q)
    with pytest.raises(ValueError, match="pack_int4"):
        pack_int4(torch.full((2, 4), 8, dtype=torch.int8))


@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_applies_groups_zeros_and_perm(bits: int) -> None:
    w = _weight(bits, 32, zeros=True, perm=True)
    q, z = w.int_values().double(), w.zeros.double()  # type: ignore[union-attr]
    stored = torch.empty_like(q)
    for i in range(q.shape[1]):
        stored[:, i] = w.scales[:, i // 32].double() * (q[:, i] - z[:, i // 32])
    expected = torch.empty_like(stored)
    expected[:, w.perm] = stored  # column perm[j] of W is column j of W'
    torch.testing.assert_close(w.dequantize(torch.float64), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("perm", [False, True])
@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_reference_product_is_the_fake_quantized_float_product(
    bits: int, zeros: bool, perm: bool
) -> None:
    w = _weight(bits, 16, zeros, perm)
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(24)
    group = activation_group(96)  # 32: blocks of 16 with the weight's groups
    stored = x if w.perm is None else x[:, w.perm]
    fake = torch.empty(7, 96, dtype=torch.float64)
    for a in range(96 // group):  # each group of the stored order quantized as a row of its own
        xq, sx = quantize_rows(stored[:, a * group : (a + 1) * group], group)
        fake[:, a * group : (a + 1) * group] = xq.double() * sx.double()
    if w.perm is not None:
        fake[:, w.perm] = fake.clone()
    expected = fake @ w.dequantize(torch.float64).T + bias.double()
    got = reference_linear(x, w, bias, int8_activations=True)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)
    plain = reference_linear(x, w, bias, int8_activations=False)
    torch.testing.assert_close(
        plain.double(),
        x.double() @ w.dequantize(torch.float64).T + bias.double(),
        rtol=1e-5,
        atol=1e-5,
    )


def test_int8_load_keeps_integers_and_row_scales_as_numpy_quantizes() -> None:
    w = torch.randn(40, 64) * torch.rand(40, 1) * 3
    w[5] = 0  # a row of zeros stays zero
    layer = QuantLinear(64, 40, scheme=QuantScheme("int8"), dtype=torch.float32, device="cpu")
    layer.load_rows(0, w[:30])
    layer.load_rows(30, w[30:].to(torch.bfloat16).to(torch.float32))
    weight = layer.unpack_weight()
    assert weight.qweight.dtype == torch.int8
    expected = int8_dequantize(torch.cat([w[:30], w[30:].to(torch.bfloat16).float()]))
    assert torch.equal(weight.dequantize(), expected)
    assert layer.weight_bytes() == 48 * 64 + 4 * 48  # as the kernel keeps it: 16-row panels


@pytest.mark.parametrize("method", ["gptq", "int8"])
def test_chosen_kernel_computes_the_reference(method: str) -> None:
    """CPU: int8 activations for both methods. CUDA's rule (gptq weight-only) is checked on
    the rule itself where no GPU is present."""
    w = _weight(4 if method == "gptq" else 8, 32, zeros=method == "gptq", perm=True)
    bias = torch.randn(24)
    kernel = quant_kernel(w, bias, torch.device("cpu"), torch.float32, method)
    for m in (1, 3, 17, 40):
        x = torch.randn(m, 96)
        expected = reference_linear(x, w, bias, int8_activations=True)
        torch.testing.assert_close(kernel(x), expected, rtol=1e-5, atol=1e-5)
    assert int8_activations(torch.device("cpu"), "gptq")
    assert not int8_activations(torch.device("cuda"), "gptq")
    assert int8_activations(torch.device("cuda"), "int8")


def test_group_order_sorts_act_order_columns_and_splits_short_groups() -> None:
    visit = torch.randperm(64, generator=torch.Generator().manual_seed(3))
    g_idx = torch.empty(64, dtype=torch.int64)
    g_idx[visit] = torch.arange(64) // 16  # GPTQ's act-order: groups by visiting order
    perm, stored, size = group_order(g_idx)
    assert perm is not None and size == 16 and stored.tolist() == [0, 1, 2, 3]
    assert torch.equal(g_idx[perm], torch.arange(64) // 16)
    assert torch.equal(torch.sort(perm[:16]).values, torch.sort(visit[:16]).values)
    last_short = torch.arange(80) // 32  # groups of 32, 32 and 16
    perm, stored, size = group_order(last_short)
    assert perm is None and size == 16 and stored.tolist() == [0, 0, 1, 1, 2]
    scattered = torch.tensor([0, 1] * 8 + [0] * 3 + [1] * 5)
    with pytest.raises(ValueError, match="act-order checkpoint split along its input"):
        group_order(scattered)
