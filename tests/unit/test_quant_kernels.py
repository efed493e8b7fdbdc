"""The quantized CPU kernels (`engine.kernels.quant_rows`) against the reference product
`engine.quant.reference.reference_linear(..., int8_activations=True)`, on every build: the native
one (AVX-512 VNNI here), AVX2 and portable C.

Tolerance: the kernels sum each group's integer products exactly, as the reference does, so
they differ only in float32 rounding of the scaled group sums: an output adds `groups` float32
products (and converts a group's sum to float, scales it by the row's scale and adds the bias),
each rounding by at most 2^-24 of the running magnitude. So |y - ref| <= 1e-5 * mag, mag the same
sum over absolute values, holds for up to ~160 groups (here at most 48).
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels.quant_rows import (
    _torch_product,
    build_quant_kernel,
    check_supported,
    kernel_isa,
    pack_quantized,
)
from engine.kernels.rows import load_rows_gemm
from engine.quant.reference import activation_group, dequantize_rows, reference_linear
from engine.quant.weights import QuantizedWeight, pack_int4


def has_flags(*flags: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return False
    return all(f" {flag}" in line for flag in flags)


@pytest.fixture(scope="module", params=["native", "avx2", "scalar"])
def variant(request: pytest.FixtureRequest) -> str:
    if request.param == "avx2" and not has_flags("avx2", "fma"):
        pytest.skip("no AVX2 on this CPU")
    if kernel_isa(request.param) is None:
        pytest.skip("no C compiler")
    return str(request.param)


def make_weight(
    out: int, k: int, bits: int, gs: int, asym: bool, perm: bool, seed: int = 0
) -> QuantizedWeight:
    """Random integers over the whole range of `bits`, positive scales of varied size."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    q = torch.randint(lo, hi + 1, (out, k), generator=g, dtype=torch.int8)
    scales = torch.rand(out, k // gs, generator=g) * 0.02 + 1e-4
    zeros = torch.randint(lo, hi + 1, (out, k // gs), generator=g, dtype=torch.int8)
    order = torch.randperm(k, generator=g) if perm else None
    qweight = q if bits == 8 else pack_int4(q)
    return QuantizedWeight(bits, gs, qweight, scales, zeros if asym else None, order)


def magnitude(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """The reference product over absolute values: what float32 rounding is relative to."""
    xs = x if w.perm is None else x[:, w.perm]
    xd = dequantize_rows(xs, activation_group(w.in_features)).to(torch.float64)
    q = w.int_values().to(torch.float64)
    if w.zeros is not None:
        q = q - w.zeros.to(torch.float64).repeat_interleave(w.group_size, dim=1)
    wa = q.abs() * w.scales.to(torch.float64).repeat_interleave(w.group_size, dim=1)
    mag = xd.abs() @ wa.T
    return mag if bias is None else mag + bias.abs().to(torch.float64)


def assert_matches(
    y: torch.Tensor,
    x: torch.Tensor,
    w: QuantizedWeight,
    bias: torch.Tensor | None,
    ref: torch.Tensor | None = None,
) -> None:
    """y within the tolerance of the reference product (`ref` when given: rows are independent,
    so one reference over many rows serves every prefix of them)."""
    ref = reference_linear(x, w, bias, int8_activations=True) if ref is None else ref
    assert y.dtype == torch.float32 and y.shape == ref.shape
    err = (y.to(torch.float64) - ref.to(torch.float64)).abs()
    bound = 1e-5 * magnitude(x, w, bias) + 1e-30
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error {worst:.3g} x the bound"


ROW_COUNTS = [*range(1, 34), 100]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group", [32, 128, "channel"])
@pytest.mark.parametrize("asym", [False, True], ids=["sym", "asym"])
@pytest.mark.parametrize("perm", [False, True], ids=["noperm", "perm"])
def test_every_format_and_row_count(
    variant: str, bits: int, group: object, asym: bool, perm: bool
) -> None:
    out, k = 40, 256  # out: two full panels and a partial one
    gs = k if group == "channel" else int(group)  # type: ignore[call-overload]
    w = make_weight(out, k, bits, gs, asym, perm, seed=bits + gs)
    for with_bias in (False, True):
        bias = torch.randn(out) if with_bias else None
        forward = build_quant_kernel(w, bias, variant=variant)  # type: ignore[arg-type]
        g = torch.Generator().manual_seed(7)
        rows = max(ROW_COUNTS)
        xs = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 3
        ref = reference_linear(xs, w, bias, int8_activations=True)
        for m in ROW_COUNTS:
            assert_matches(forward(xs[:m]), xs[:m], w, bias, ref[:m])


@pytest.mark.parametrize(
    ("out", "k", "bits", "gs"),
    [(1, 8, 4, 8), (17, 72, 4, 8), (17, 72, 8, 4), (33, 576, 4, 64), (5, 1536, 8, 1536),
     (49, 1536, 4, 32), (3, 12, 8, 12)],
)  # fmt: skip
def test_odd_shapes(variant: str, out: int, k: int, bits: int, gs: int) -> None:
    """Any out features; in features any multiple of the group size (not of 64 or 16)."""
    for asym, perm in ((False, False), (True, True)):
        w = make_weight(out, k, bits, gs, asym, perm, seed=out + k)
        bias = torch.randn(out)
        forward = build_quant_kernel(w, bias, variant=variant)  # type: ignore[arg-type]
        for m in (1, 3, 16, 21):
            x = torch.randn(m, k)
            assert_matches(forward(x), x, w, bias)


def test_special_rows(variant: str) -> None:
    """A row of zeros (scale 0), a row that saturates, a strided view of x, and no rows."""
    w = make_weight(24, 64, 4, 32, True, True)
    forward = build_quant_kernel(w, None, variant=variant)  # type: ignore[arg-type]
    wide = torch.randn(4, 100)
    wide[1] = 0.0
    wide[2, 5] = 1e6
    x = wide[:, :64]  # row stride 100
    assert_matches(forward(x), x, w, None)
    assert torch.all(forward(x)[1] == 0.0)
    assert forward(torch.empty(0, 64)).shape == (0, 24)


def test_builds_agree() -> None:
    """Every build sums the same integers: outputs within float32 rounding of one another."""
    w = make_weight(64, 512, 4, 128, True, True)
    x = torch.randn(9, 512)
    outs = [build_quant_kernel(w, None, variant=v)(x) for v in ("native", "scalar")]  # type: ignore[arg-type]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_isa_names() -> None:
    assert kernel_isa("scalar") in ("scalar", None)
    if has_flags("avx2", "fma"):
        assert kernel_isa("avx2") == "avx2"
    native = kernel_isa("native")
    if has_flags("avx512f", "avx512_vnni"):
        assert native == "avx512-vnni"


@pytest.mark.parametrize(("bits", "gs", "k"), [(4, 4, 64), (8, 2, 64), (4, 12, 72)])
def test_refuses_groups_the_layout_cannot_take(bits: int, gs: int, k: int) -> None:
    w = make_weight(16, k, bits, gs, False, False)
    with pytest.raises(ValueError, match=f"{bits}-bit weight needs group_size a multiple of"):
        check_supported(w)
    with pytest.raises(ValueError, match="group_size"):
        build_quant_kernel(w, None)


def test_aten_fallback_matches() -> None:
    """The product without a C compiler: the same maths through ATen."""
    for bits, gs, asym, perm in ((8, 64, True, True), (4, 32, False, True), (8, 64, False, False)):
        w = make_weight(20, 128, bits, gs, asym, perm)
        bias = torch.randn(20)
        x = torch.randn(5, 128)
        assert_matches(_torch_product(w, bias)(x), x, w, bias)


@pytest.mark.parametrize(
    ("out", "k", "bits", "gs", "asym", "perm"),
    [(40, 64, 8, 64, False, False), (20, 128, 8, 32, True, True), (33, 96, 4, 32, True, True),
     (16, 64, 4, 64, False, False)],
)  # fmt: skip
def test_unpack_gives_back_the_weight(
    out: int, k: int, bits: int, gs: int, asym: bool, perm: bool
) -> None:
    """The kernel's copy is the layer's only one: what it unpacks is the weight it was built
    from, field for field (output features padded to 16 dropped again)."""
    w = make_weight(out, k, bits, gs, asym, perm)
    for got in (pack_quantized(w).unpack(), build_quant_kernel(w, None).unpack()):
        assert (got.bits, got.group_size) == (w.bits, w.group_size)
        for a, b in ((got.qweight, w.qweight), (got.scales, w.scales), (got.zeros, w.zeros),
                     (got.perm, w.perm)):  # fmt: skip
            assert (a is None) == (b is None)
            assert a is None or b is None or (a.dtype == b.dtype and torch.equal(a, b))


def test_resident_bytes() -> None:
    """About one byte a weight (8 bits), half a byte (4 bits), plus scales and zeros."""
    out, k = 1536, 576
    int8 = pack_quantized(make_weight(out, k, 8, k, False, False))
    assert int8.nbytes == out * k + out * 4
    q4 = pack_quantized(make_weight(out, k, 4, 64, True, True))
    assert q4.nbytes == out * k // 2 + out * (k // 64) * 5 + k * 8
    assert q4.nbytes / (out * k) < 0.6


@pytest.mark.parametrize("spin_us", [0, 500])
def test_reading_ahead_leaves_the_products_unchanged(spin_us: int) -> None:
    """A worker asked to read the next products' weights ahead (whether it is spinning or
    asleep, the request taken or replaced, or stopped by the next call) changes no result:
    each product equals the same kernel's without read-ahead, bit for bit."""
    rows = load_rows_gemm()
    if rows is None:
        pytest.skip("no C compiler")
    threads = rows.threads
    rows.set_threads(2)
    rows.set_spin_us(spin_us)
    try:
        weights = [make_weight(256 + 16 * i, 512, 8 if i % 2 else 4, 128, i % 3 == 0, False, i)
                   for i in range(6)]  # fmt: skip
        kernels = [build_quant_kernel(w, None) for w in weights]
        rows.set_threads(2)  # the build set torch's count
        x = torch.randn(3, 512)
        expected = [kernel(x) for kernel in kernels]
        for _ in range(20):
            for i, kernel in enumerate(kernels):
                kernels[(i + 1) % len(kernels)].read_ahead()
                if i % 2:
                    kernels[(i + 2) % len(kernels)].read_ahead()  # replaces the request
                assert torch.equal(kernel(x), expected[i])
    finally:
        rows.set_spin_us(500)
        rows.set_threads(threads)
