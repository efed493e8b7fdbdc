"""engine.layers.linear against an independent float64 oracle."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.autotune import select_kernels
from engine.kernels.buffers import OutputBuffer
from engine.kernels.matmul import KERNELS, ROWS_MAX, default_kernel
from engine.layers.linear import Linear

SHAPES = [(64, 96), (96, 40)]  # (in, out)
MS = [1, 3, 8, 33, 300]


def make(k: int, n: int, bias: bool, seed: int = 0) -> tuple[Linear, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn((n, k), generator=g, dtype=torch.float64)
    b = torch.randn(n, generator=g, dtype=torch.float64)
    layer = Linear(k, n, bias=bias, dtype=torch.float32, device="cpu")
    layer.load_rows(0, w)
    if bias:
        layer.load_bias(0, b)
    # oracle uses the fp32-rounded weights the layer holds, in float64
    return layer, w.float().double(), b.float().double()


def oracle(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.t()
    return y if b is None else y + b


def check(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert y.dtype == torch.float32 and y.shape == ref.shape
    scale = ref.abs().max().item() if ref.numel() else 1.0
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * scale)


def available(layer: Linear) -> list[str]:
    return [name for name, spec in KERNELS.items() if spec.supports(layer)]


def test_cpu_fp32_has_all_kernels() -> None:
    layer = Linear(8, 8, dtype=torch.float32, device="cpu")
    assert set(available(layer)) == {"torch", "rows"}


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_every_kernel_matches_oracle(k: int, n: int, bias: bool) -> None:
    layer, w, b = make(k, n, bias)
    g = torch.Generator().manual_seed(1)
    for name in available(layer):
        fn = KERNELS[name].build(layer, {})
        for m in MS:
            x = torch.randn((m, k), generator=g)
            check(fn(x), oracle(x, w, b if bias else None))


@pytest.mark.parametrize("bias", [False, True])
def test_forward_default_and_after_selection(bias: bool) -> None:
    layers = [make(64, 96, bias, seed=s) for s in range(3)]
    xs = [torch.randn(m, 64) for m in [*MS, 0, 64, 65, 500]]
    for phase in ("default", "selected"):
        if phase == "selected":
            table = select_kernels([ly for ly, _, _ in layers], m_values=(1, 4, 16), target_s=2e-4)
            assert set(table.chosen[(64, 96)]) == {1, 4, 16}
        for layer, w, b in layers:
            for x in xs:
                check(layer(x), oracle(x, w, b if bias else None))


def test_forward_non_contiguous_input_and_inference_mode() -> None:
    layer, w, _ = make(64, 96, False)
    for name in available(layer):
        fn = KERNELS[name].build(layer, {})
        x = torch.randn(64, 10).t()  # [10, 64], non-contiguous
        check(fn(x), oracle(x, w, None))
        with torch.inference_mode():
            x = torch.randn(5, 64)
            check(fn(x), oracle(x, w, None))


def test_load_rows_fused_from_parts() -> None:
    k = 32
    parts = [torch.randn(n, k, dtype=torch.bfloat16) for n in (16, 8, 8)]  # q, k, v
    layer = Linear(k, 32, dtype=torch.float32, device="cpu")
    offset = 0
    for p in parts:
        layer.load_rows(offset, p)
        offset += p.shape[0]
    full = torch.cat(parts).float()
    assert torch.equal(layer.weight_view(), full)
    x = torch.randn(7, k)
    check(layer(x), oracle(x, full.double(), None))


def test_load_bias_at_offsets() -> None:
    layer = Linear(4, 6, bias=True, dtype=torch.float32, device="cpu")
    layer.load_bias(0, torch.arange(3.0))
    layer.load_bias(3, torch.arange(3.0, 6.0))
    assert layer.bias is not None and torch.equal(layer.bias, torch.arange(6.0))
    assert torch.equal(layer(torch.zeros(2, 4)), torch.arange(6.0).expand(2, 6))


def test_embedding_rows() -> None:
    layer, w, _ = make(24, 50, False)
    ids = torch.tensor([0, 49, 7, 7, 13], dtype=torch.int64)
    rows = layer.embedding_rows(ids)
    assert rows.shape == (5, 24) and rows.is_contiguous()
    assert torch.equal(rows, w.float()[ids])


@pytest.mark.parametrize(
    ("offset", "shape"), [(0, (4, 7)), (0, (9, 8)), (6, (3, 8)), (-1, (2, 8)), (0, (8,))]
)
def test_load_rows_wrong_shape_raises(offset: int, shape: tuple[int, ...]) -> None:
    layer = Linear(8, 8, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=r"\[8, 8\]|\[rows, 8\]"):
        layer.load_rows(offset, torch.zeros(shape))


def test_load_bias_wrong_shape_raises() -> None:
    with pytest.raises(ValueError, match="bias=False"):
        Linear(4, 4, dtype=torch.float32, device="cpu").load_bias(0, torch.zeros(4))
    layer = Linear(4, 4, bias=True, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=r"\[5\]"):
        layer.load_bias(0, torch.zeros(5))


def test_selection_rejects_inexact_and_failing_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel that computes in bfloat16 is fast but inexact, one that raises is unusable: neither
    may be chosen, even over a slow exact kernel."""
    from engine.kernels import matmul as mod

    def build_bf16(layer: Linear, shared: dict) -> mod.KernelFn:
        w = layer.weight_view().bfloat16()
        return lambda x: (x.bfloat16() @ w.t()).float()

    def build_raising(layer: Linear, shared: dict) -> mod.KernelFn:
        def run(x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("unsupported")

        return run

    def build_slow(layer: Linear, shared: dict) -> mod.KernelFn:
        inner = mod._build_torch(layer, shared)

        def run(x: torch.Tensor) -> torch.Tensor:
            for _ in range(20):
                y = inner(x)
            return y

        return run

    layer, w, _ = make(256, 128, False)
    fake = {
        name: mod.KernelSpec(name, name, lambda _: True, build)
        for name, build in [("cheat", build_bf16), ("raises", build_raising), ("slow", build_slow)]
    }
    monkeypatch.setattr(mod, "KERNELS", fake)
    table = select_kernels([layer], m_values=(1, 8), target_s=2e-4)
    assert table.chosen[(256, 128)] == {1: "slow", 8: "slow"}
    exact = {(t.kernel, t.m): t.exact for t in table.timings}
    assert exact == {(n, m): n == "slow" for n in fake for m in (1, 8)}
    x = torch.randn(8, 256)
    check(layer(x), oracle(x, w, None))
    assert "inexact" in table.format()


def test_selection_shares_shapes_and_reports() -> None:
    layers = [make(64, 96, False, seed=s)[0] for s in range(2)] + [make(96, 40, True)[0]]
    table = select_kernels(layers, m_values=(1, 8), target_s=2e-4)
    assert set(table.chosen) == {(64, 96), (96, 40)}
    # one timing row per (shape, M, kernel), shared by the two layers of shape (64, 96)
    assert len(table.timings) == 2 * 2 * len(available(layers[0]))
    for layer in layers:
        shape = (layer.in_features, layer.out_features)
        assert layer.kernel_names == table.chosen[shape]
        for m, name in table.chosen[shape].items():
            cell = next(t for t in table.timings if (t.shape, t.m, t.kernel) == (shape, m, name))
            assert cell.exact
    assert "64->96" in table.format()


def test_selection_times_whole_passes() -> None:
    """Where shapes chose differently, or a kernel other than the default was chosen, whole
    passes decide: the fastest variant is installed on every layer (the default kernel on every
    layer unless the fastest beats it by more than the margin), and the table reports it."""
    layers = [make(64, 96, False, seed=s)[0] for s in range(3)] + [make(96, 64, True)[0]]
    table = select_kernels(layers, m_values=(1, 8), target_s=2e-4)
    for m, times in table.passes.items():
        assert times and all(t > 0 for t in times.values())
        fastest = min(times, key=lambda v: times[v])
        default = f"all {default_kernel(m)}"
        if default in times and times[default] <= 1.25 * times[fastest]:
            fastest = default
        names = {plan[m] for plan in table.chosen.values()}
        if fastest.startswith("all "):
            assert names == {fastest.removeprefix("all ")}
        else:
            assert fastest == "per shape" and len(names) > 1
        assert f"one pass, M {m}" in table.format()
    for layer in layers:
        x = torch.randn(8, layer.in_features)
        ref = x.double() @ layer.weight_view().double().t()
        check(layer(x), ref if layer.bias is None else ref + layer.bias.double())
    # one kernel everywhere, the default: nothing to compare
    only_rows = select_kernels(layers, m_values=(1, 8), kernels=["rows"], target_s=2e-4)
    assert only_rows.passes == {}


@pytest.mark.parametrize(("default_ms", "installed"), [(1.2, "rows"), (1.3, "torch")])
def test_whole_passes_keep_the_default_within_the_margin(
    monkeypatch: pytest.MonkeyPatch, default_ms: float, installed: str
) -> None:
    """A pass with another kernel must beat the default kernel's pass by more than
    `default_margin` (1.25) to replace it: the passes miss the ops between the products."""
    from engine.kernels import autotune

    def passes(calls: dict[str, list[object]], rounds: int) -> dict[str, float]:
        assert {"all rows", "all torch"} <= set(calls)
        return {v: default_ms if v == "all rows" else 1.0 for v in calls}

    time_cell = autotune._time_cell

    def cells(*args: object, **kwargs: object) -> dict[str, autotune.Timing]:
        timed = time_cell(*args, **kwargs)  # type: ignore[arg-type]
        timed["torch"].ms = timed["rows"].ms / 10  # one shape at a time, torch wins
        return timed

    monkeypatch.setattr(autotune, "_time_cell", cells)
    monkeypatch.setattr(autotune, "_time_passes", passes)
    layers = [make(64, 96, False, seed=s)[0] for s in range(2)]
    table = select_kernels(layers, m_values=(4,), kernels=["rows", "torch"], target_s=2e-4)
    assert table.chosen[(64, 96)] == {4: installed}
    assert {layer.kernel_names[4] for layer in layers} == {installed}


def test_non_fp32_cpu_uses_torch() -> None:
    layer = Linear(16, 8, dtype=torch.float64, device="cpu")
    assert available(layer) == ["torch"] and layer.kernel_names == {1: "torch"}
    w = torch.randn(8, 16, dtype=torch.float64)
    layer.load_rows(0, w)
    x = torch.randn(3, 16, dtype=torch.float64)
    torch.testing.assert_close(layer(x), x @ w.t())
    table = select_kernels([layer], m_values=(1, 4), target_s=2e-4)
    assert table.chosen[(16, 8)] == {1: "torch", 4: "torch"}
    torch.testing.assert_close(layer(x), x @ w.t())


def test_defaults_and_layout() -> None:
    layer = Linear(24, 40, dtype=torch.float32, device="cpu")
    assert layer.kernel_names == {ROWS_MAX: "rows", ROWS_MAX + 1: "torch"}
    assert layer.storage.shape == (24, 40) and layer.storage.is_contiguous()  # W^T [in, out]
    assert layer.weight_view().shape == (40, 24)


def test_default_rows_kernel_packs_at_first_call_and_after_each_load() -> None:
    """The default plan's "rows" kernel is built before the weights load: it must read the
    weights as they are at its first call, and again after every load_rows / load_bias."""
    layer = Linear(64, 96, bias=True, dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, generator=g)
    for _ in range(2):
        w = torch.randn(96, 64, generator=g, dtype=torch.float64)
        b = torch.randn(96, generator=g, dtype=torch.float64)
        layer.load_rows(0, w)
        layer.load_bias(0, b)
        check(layer(x), oracle(x, w.float().double(), b.float().double()))
        check(layer(x[:1]), oracle(x[:1], w.float().double(), b.float().double()))
    layer.load_rows(32, torch.zeros(64, 64))  # a partial load after a call
    assert not layer(x)[:, 32:].ne(layer.bias[32:]).any()


def test_non_cpu_layout_is_plain() -> None:
    """Non-CPU devices (CUDA in production; 'meta' here) store W [out, in] and use F.linear."""
    layer = Linear(8, 6, bias=True, dtype=torch.float32, device="meta")
    assert layer.storage.shape == (6, 8) and layer.kernel_names == {1: "torch"}
    layer.load_rows(0, torch.randn(6, 8))
    layer.load_bias(0, torch.randn(6))
    assert layer(torch.empty(3, 8, device="meta")).shape == (3, 6)
    assert layer.embedding_rows(torch.tensor([1, 2], device="meta")).shape == (2, 8)
    assert select_kernels([layer]).chosen == {}


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_results_in_a_shared_buffer_are_right_until_its_next_take(gated: bool) -> None:
    """Two layers with one output buffer: each product (and fused SiLU x up) is right when
    returned, in the buffer's memory, which the next call of either layer writes over; above
    its rows, and for a layer without a buffer, every call returns memory of its own."""
    k, n = 64, 96
    plain, w, _ = make(k, n, bias=False)
    _, w2, _ = make(k, n, bias=False, seed=1)
    buffer = OutputBuffer()
    first = Linear(k, n, dtype=torch.float32, device="cpu", gated=gated, output=buffer)
    second = Linear(k, n, dtype=torch.float32, device="cpu", gated=gated, output=buffer)
    first.load_rows(0, w)
    second.load_rows(0, w2)
    g = torch.Generator().manual_seed(2)
    x1, x2 = torch.randn((5, k), generator=g), torch.randn((3, k), generator=g)
    y1 = first.forward(x1)
    check(y1, oracle(x1, w, None))
    y2 = second.forward(x2)
    check(y2, oracle(x2, w2, None))
    assert y2.data_ptr() == y1.data_ptr() and torch.equal(y1[:3], y2)
    if gated:
        gate, up = oracle(x2, w, None).chunk(2, dim=-1)
        s = first.silu_and_mul(x2)
        assert s is not None
        check(s, torch.nn.functional.silu(gate) * up)
    big = torch.randn((buffer.max_rows + 1, k), generator=g)
    z1, z2 = first.forward(big), first.forward(big)
    assert z1.data_ptr() != z2.data_ptr()
    check(z1, oracle(big, w, None))
    a, b = plain.forward(x2), plain.forward(x2)
    assert a.data_ptr() != b.data_ptr()
