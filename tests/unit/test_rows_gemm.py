"""The "rows" linear kernel (engine/kernels/rows_gemm.c) against a float64 reference: every row
count of a pass and beyond, odd shapes, bias, 1 and 2 threads, each compiled path, and through
`select_kernels`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.kernels.autotune import faster_rounds_medians, select_kernels
from engine.kernels.cpu import load_cpu_kernels
from engine.kernels.matmul import KERNELS
from engine.kernels.rows import PREFETCH_MODES, RowsGemm, load_rows_gemm
from engine.layers.linear import Linear

ROWS = [*range(1, 18), 24, 33, 64]
SHAPES = [(7, 13), (64, 96), (33, 200), (576, 960), (1536, 576), (576, 1536)]  # (in, out)


def has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(ln.startswith("flags") and " avx2" in ln and " fma" in ln for ln in f)
    except OSError:
        return False


@pytest.fixture(scope="module", params=["native", "avx2", "scalar"])
def lib(request: pytest.FixtureRequest) -> RowsGemm:
    if request.param == "avx2" and not has_avx2():
        pytest.skip("no AVX2 on this CPU")
    lib = load_rows_gemm(request.param)
    assert lib is not None, "rows_gemm.c must build on a machine with a C compiler"
    if request.param != "native":
        assert lib.isa == request.param
    return lib


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_matches_float64(lib: RowsGemm, k: int, n: int, threads: int) -> None:
    g = torch.Generator().manual_seed(k * n)
    wt = torch.randn(k, n, generator=g)  # W^T [in, out]
    b = torch.randn(n, generator=g)
    packed, bias = lib.pack(wt), lib.pad_bias(b)
    assert packed.shape == (-(-n // 16), k, 16)
    before = lib.threads
    lib.set_threads(threads)
    try:
        for m in ROWS:
            x = torch.randn(m, k, generator=g)
            ref = x.double() @ wt.double()  # [M, out]
            y = lib.matmul(x, packed, n)
            assert y.shape == (m, n) and y.dtype == torch.float32
            assert rel_err(y, ref) < 1e-5, (m, "no bias")
            assert rel_err(lib.matmul(x, packed, n, bias), ref + b.double()) < 1e-5, (m, "bias")
    finally:
        lib.set_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_inplace_matches_packed(lib: RowsGemm, threads: int) -> None:
    """W^T read in place (a row stride wider than the columns, bias [out]) gives the packed
    kernel's float32 sums; out features that are not a multiple of 16 are refused."""
    g = torch.Generator().manual_seed(4)
    wide = torch.randn(576, 1000, generator=g)
    wt, b = wide[:, :960], torch.randn(960, generator=g)  # W^T [576, 960], row stride 1000
    packed, bias = lib.pack(wt), lib.pad_bias(b)
    before = lib.threads
    lib.set_threads(threads)
    try:
        for m in (1, 4, 9, 16, 20):
            x = torch.randn(m, 576, generator=g)
            assert torch.equal(lib.matmul_inplace(x, wt, b), lib.matmul(x, packed, 960, bias))
            assert rel_err(lib.matmul_inplace(x, wt), x.double() @ wt.double()) < 1e-5
    finally:
        lib.set_threads(before)
    with pytest.raises(ValueError, match="multiple of 16"):
        lib.matmul_inplace(torch.randn(2, 576), wide[:, :200])


def test_strided_input_and_row_groups(lib: RowsGemm) -> None:
    """A non-contiguous x, and every rows-per-pass setting, give the same float32 sums (the
    vector paths fuse every multiply-add; portable C leaves that to the compiler). k spans
    three blocks of steps, the last one short, and a quarter of the last panel is padding."""
    g = torch.Generator().manual_seed(1)
    wt = torch.randn(300, 76, generator=g)
    packed = lib.pack(wt)
    x = torch.randn(300, 40, generator=g).t()[:13]  # [13, 300], row stride 1 after .t() -> copied
    wide = torch.randn(13, 310, generator=g)[:, :300]  # [13, 300], row stride 310
    ref = lib.matmul(x.contiguous(), packed, 76)
    assert rel_err(ref, x.double() @ wt.double()) < 1e-5
    assert torch.equal(lib.matmul(x, packed, 76), ref)
    assert torch.equal(lib.matmul(wide, packed, 76), lib.matmul(wide.contiguous(), packed, 76))
    before = lib.group_rows
    for rows in (1, 3, 6, 7, 8, 12, 14, 16):
        lib.set_group_rows(rows)
        try:
            y = lib.matmul(x, packed, 76)
            if lib.isa == "scalar":
                torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-5)
            else:
                assert torch.equal(y, ref)  # same k order and fused steps in every tile
        finally:
            lib.set_group_rows(before)


def test_prefetch_setting_keeps_the_sums(lib: RowsGemm) -> None:
    """Every prefetch mode, at every tile row count, gives the same float32 sums, on float and
    int8 weights and across row groups; a bad row count or mode is refused and changes nothing."""
    g = torch.Generator().manual_seed(5)
    wt = torch.randn(576, 200, generator=g)
    packed, (q8, scales) = lib.pack(wt), lib.pack_q8(wt)
    x = torch.randn(20, 576, generator=g)
    rows = range(1, lib.max_rows + 1)
    before = {r: lib.prefetch(r) for r in rows}
    assert before[1] == "none"
    try:
        lib.set_prefetch("none")
        ms = (2, 3, 8, 20)
        ref = {m: lib.matmul(x[:m], packed, 200) for m in ms}
        ref_q8 = {m: lib.matmul_q8(x[:m], q8, scales, 200) for m in ms}
        for mode in PREFETCH_MODES:
            lib.set_prefetch(mode)
            assert all(lib.prefetch(r) == mode for r in rows[1:])
            for m in ms:
                y = lib.matmul(x[:m], packed, 200)
                assert rel_err(y, x[:m].double() @ wt.double()) < 1e-5
                assert torch.equal(y, ref[m])
                assert torch.equal(lib.matmul_q8(x[:m], q8, scales, 200), ref_q8[m])
        lib.set_prefetch("nta")
        lib.set_prefetch("l2", rows=3)
        assert [lib.prefetch(r) for r in (2, 3, 4)] == ["nta", "l2", "nta"]
        for bad_rows in (1, lib.max_rows + 1):
            with pytest.raises(ValueError):
                lib.set_prefetch("l2", rows=bad_rows)
        with pytest.raises(ValueError):
            lib.set_prefetch("t0", rows=2)
        with pytest.raises(ValueError):
            lib.prefetch(0)
        assert lib.prefetch(2) == "nta" and lib.prefetch(1) == "none"
    finally:
        for r, mode in before.items():
            if r > 1:
                lib.set_prefetch(mode, r)


def silu_and_mul_ref(y: torch.Tensor) -> torch.Tensor:
    """[M, 2d] float64 gate, then up -> silu(gate) * up [M, d]."""
    gate, up = y.chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("k", "d"), [(7, 16), (40, 48), (576, 1536)])
def test_gated_pairs(lib: RowsGemm, k: int, d: int, threads: int) -> None:
    """Panels packed in (gate, up) pairs: the product in W^T's column order is the plain
    kernel's bit for bit, and the fused silu(gate) * up matches float64 within 1e-5 and the
    separate SiLU kernel on the plain product within float32 rounding; for every row count,
    rows per pass (one-panel tiles included), bias or not. Halves that are not whole panels are
    refused."""
    g = torch.Generator().manual_seed(k + d)
    wt, b = torch.randn(k, 2 * d, generator=g), torch.randn(2 * d, generator=g)
    packed, pairs = lib.pack(wt), lib.pack_pairs(wt)
    kernels = load_cpu_kernels()
    assert kernels is not None
    before_threads, before_rows = lib.threads, lib.group_rows
    lib.set_threads(threads)
    try:
        for group_rows in (before_rows, lib.max_rows):
            lib.set_group_rows(group_rows)
            for m in ROWS:
                x = torch.randn(m, k, generator=g)
                for bias in (None, b):
                    plain = lib.matmul(
                        x, packed, 2 * d, None if bias is None else lib.pad_bias(bias)
                    )
                    pb = None if bias is None else lib.pad_bias_pairs(bias)
                    assert torch.equal(lib.matmul_pairs(x, pairs, 2 * d, pb), plain), m
                    h = lib.matmul_pairs(x, pairs, 2 * d, pb, silu=True)
                    ref = x.double() @ wt.double() + (0 if bias is None else bias.double())
                    assert h.shape == (m, d)
                    assert rel_err(h, silu_and_mul_ref(ref)) < 1e-5, m
                    torch.testing.assert_close(h, kernels.silu_and_mul(plain), rtol=1e-6, atol=1e-6)
    finally:
        lib.set_threads(before_threads)
        lib.set_group_rows(before_rows)
    with pytest.raises(ValueError, match="multiple of 32"):
        lib.pack_pairs(torch.randn(k, 48))


def test_gated_linear_fuses_where_the_rows_kernel_serves() -> None:
    """A gated `Linear` fuses SiLU-and-multiply into its product wherever the "rows" kernel
    serves M (1 to 64 rows), before and after selection, and hands it back (None) above; its
    plain product is unchanged by the paired packing."""
    layer = Linear(64, 96, dtype=torch.float32, device="cpu", gated=True)
    g = torch.Generator().manual_seed(3)
    layer.load_rows(0, torch.randn(96, 64, generator=g))
    kernels = load_cpu_kernels()
    assert kernels is not None
    for _ in ("default plan", "selected"):
        for m in (1, 8, 64, 65):
            x = torch.randn(m, 64, generator=g)
            ref = x.double() @ layer.weight_view().double().t()
            assert rel_err(layer(x), ref) < 1e-5
            h = layer.silu_and_mul(x)
            if m > 64:
                assert h is None
            else:
                assert h is not None and rel_err(h, silu_and_mul_ref(ref)) < 1e-5
        table = select_kernels([layer], m_values=(1, 8), kernels=["rows"], target_s=2e-4)
        assert table.chosen[(64, 96)] == {1: "rows", 8: "rows"}
    assert Linear(64, 96, dtype=torch.float32, device="cpu").silu_and_mul(x[:1]) is None


def test_prefetch_modes_compared_in_the_faster_rounds() -> None:
    # Five rounds on a host whose memory is slow in three: there "l2" trails "none" by 1%; in
    # the two fast rounds it leads by 20%. The median over all rounds would choose "none" (1.0
    # against 1.01); over the faster half (rounds 1, 3 and the fastest slow one, 4) it is "l2".
    times = {
        "none": [17.0, 12.0, 17.4, 13.2, 16.5],
        "l2": [17.17, 10.0, 17.574, 11.0, 16.665],
    }
    medians = faster_rounds_medians(times)
    assert medians["l2"] == 1.0
    assert medians["none"] == pytest.approx(1.2)
    # with only slow rounds, the 1% decides
    slow = faster_rounds_medians({v: [t[0], t[2], t[4]] for v, t in times.items()})
    assert slow["none"] == 1.0
    assert slow["l2"] == pytest.approx(1.01)


def test_registered_and_selected_as_exact() -> None:
    layer = Linear(576, 200, bias=True, dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(2)
    layer.load_rows(0, torch.randn(200, 576, generator=g) * 576**-0.5)
    layer.load_bias(0, torch.randn(200, generator=g))
    assert KERNELS["rows"].supports(layer)
    assert not KERNELS["rows"].supports(Linear(8, 8, dtype=torch.float64, device="cpu"))
    table = select_kernels([layer], m_values=(1, 4, 16), kernels=["rows"], target_s=2e-4)
    assert table.chosen[(576, 200)] == {1: "rows", 4: "rows", 16: "rows"}
    # the prefetch mode per tile row count is chosen by timing too: at each M timed (up to the
    # rows of one pass, and that), the fastest mode; other row counts take the nearest M's
    lib = load_rows_gemm()
    assert lib is not None
    top = lib.group_rows
    assert sorted(table.rows_prefetch) == sorted({m for m in (4, top) if m <= top})
    fastest = {m: min(t, key=lambda v: t[v]) for m, t in table.rows_prefetch.items()}
    assert all(set(t) == set(PREFETCH_MODES) for t in table.rows_prefetch.values())
    assert lib.prefetch(4) == fastest[4] and lib.prefetch(top) == fastest[top]
    assert lib.prefetch(2) == fastest[4] and lib.prefetch(lib.max_rows) == fastest[top]
    assert all(t.exact for t in table.timings)
    for m in (1, 2, 5, 16, 40):
        x = torch.randn(m, 576, generator=g)
        assert layer.bias is not None
        ref = x.double() @ layer.weight_view().double().t() + layer.bias.double()
        assert rel_err(layer(x), ref) < 1e-5


def test_threads_default_to_torch() -> None:
    layer = Linear(32, 48, dtype=torch.float32, device="cpu")
    lib = load_rows_gemm()
    assert lib is not None
    lib.set_threads(1)
    KERNELS["rows"].build(layer, {})
    assert lib.threads == torch.get_num_threads()


def test_threads_are_set_when_built_not_at_the_first_call() -> None:
    """A layer's default "rows" kernel packs at its first call, which may come while torch is
    held to one thread (as the ATen attention backend holds it): the process-wide thread count
    must stay the one torch had when the kernel was built."""
    lib = load_rows_gemm()
    assert lib is not None
    threads = torch.get_num_threads()
    layer = Linear(32, 48, dtype=torch.float32, device="cpu")  # built: threads set now
    torch.set_num_threads(1)
    try:
        layer(torch.randn(2, 32))  # the first call packs the weights
    finally:
        torch.set_num_threads(threads)
    assert lib.threads == threads


# int8 products ("q8"): shapes (in, out) with odd sizes and a speculator-sized head.
Q8_PACK_SHAPES = [(7, 13), (33, 200), (576, 960), (576, 4096)]


def quantise_ref(wt: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """wt float32 -> (q int8, scales float32) symmetric along `dim` (per output feature of W^T
    [in, out]; dim=1: per row of x): scale = max |.| / 127 (0 for zeros),
    q = round-half-even(wt / scale) in [-127, 127]."""
    scales = wt.abs().amax(dim, keepdim=True) / 127
    q = torch.where(scales > 0, torch.round(wt / scales), torch.zeros_like(wt))
    return q.clamp(-127, 127).to(torch.int8), scales.squeeze(dim)


def panels_ref(q: torch.Tensor) -> torch.Tensor:
    """q [in, out] int8 -> q + 128 as uint8 [ceil(out/16), ceil(in/4), 16, 4]: panels of 16
    output features by groups of 4 input features, padding q = 0."""
    k, n = q.shape
    p, g = -(-n // 16), -(-k // 4)
    padded = torch.zeros(g * 4, p * 16, dtype=torch.int16)
    padded[:k, :n] = q
    grouped = (padded + 128).to(torch.uint8).view(g, 4, p, 16)  # [G, 4, P, 16]
    return grouped.permute(2, 0, 3, 1).contiguous()


@pytest.mark.parametrize(("k", "n"), Q8_PACK_SHAPES)
def test_pack_q8_matches_reference(lib: RowsGemm, k: int, n: int) -> None:
    """Exact byte panels and scales within 1 ulp, a zero column included, from a strided W^T;
    `unpack_q8` gives back q."""
    g = torch.Generator().manual_seed(k + n)
    wide = torch.randn(k, n + 5, generator=g) * torch.rand(n + 5, generator=g)  # varied columns
    wide[:, n // 2] = 0.0  # a column of zeros: scale 0, q 0
    wt = wide[:, :n]  # W^T [in, out], row stride n + 5
    packed, scales = lib.pack_q8(wt)
    assert packed.shape == (-(-n // 16), -(-k // 4), 16, 4) and packed.dtype == torch.uint8
    assert scales.shape == (-(-n // 16) * 16,) and scales.dtype == torch.float32
    q, s = quantise_ref(wt)
    assert torch.equal(packed, panels_ref(q))
    assert torch.equal(lib.unpack_q8(packed, k)[:n], q.T)
    assert int(q.abs().max()) == 127  # every nonzero column reaches the full range
    torch.testing.assert_close(scales[:n], s, rtol=2**-23, atol=0.0)
    assert scales[n // 2] == 0 and torch.all(scales[n:] == 0)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_q8_is_the_integer_product_scaled(lib: RowsGemm, k: int, n: int, threads: int) -> None:
    """matmul_q8 is (q_x @ q^T) * scale_x * scale (+ bias), each row of x quantised as a column
    of W^T, the integer sums exact (float64 holds them exactly), for every row count; a row of
    zeros gives zeros."""
    g = torch.Generator().manual_seed(k * n + 1)
    wt = torch.randn(k, n, generator=g)  # W^T [in, out]
    b = torch.randn(n, generator=g)
    packed, scales = lib.pack_q8(wt)
    bias = lib.pad_bias(b)
    q = lib.unpack_q8(packed, k)[:n].double()  # [out, in]
    before = lib.threads
    lib.set_threads(threads)
    try:
        for m in ROWS:
            x = torch.randn(m, k, generator=g)
            x[m // 2] = 0.0
            qx, sx = quantise_ref(x, dim=1)
            sums = qx.double() @ q.T  # [M, out], exact
            ref = sums * sx.double()[:, None] * scales[:n].double()
            y = lib.matmul_q8(x, packed, scales, n)
            assert y.shape == (m, n) and y.dtype == torch.float32
            torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=1e-6)
            assert torch.all(y[m // 2] == 0)
            yb = lib.matmul_q8(x, packed, scales, n, bias)
            torch.testing.assert_close(yb.double(), ref + b.double(), rtol=1e-6, atol=1e-5)
    finally:
        lib.set_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_q8_close_to_float(lib: RowsGemm, threads: int) -> None:
    """On random normal weights and inputs, int8 weights and inputs with a scale per output
    feature and per row cost well under 1.5% of the float product (about 1.06% expected: a step
    of 2 * 3.3 sigma / 254 on each side), and rows of x read at a stride or in other row groups
    give the same sums."""
    g = torch.Generator().manual_seed(5)
    wt = torch.randn(576, 4096, generator=g) * 576**-0.5  # W^T [in, out], a vocabulary head
    packed, scales = lib.pack_q8(wt)
    before = lib.threads
    lib.set_threads(threads)
    try:
        for m in (1, 5, 15):
            x = torch.randn(m, 576, generator=g)
            ref = x.double() @ wt.double()
            assert rel_err(lib.matmul_q8(x, packed, scales, 4096), ref) < 0.015, m
        x = torch.randn(13, 700, generator=g)[:, :576]  # [13, 576], row stride 700
        y = lib.matmul_q8(x, packed, scales, 4096)
        assert torch.equal(y, lib.matmul_q8(x.contiguous(), packed, scales, 4096))
        group_rows = lib.group_rows
        lib.set_group_rows(3)
        try:
            assert torch.equal(lib.matmul_q8(x, packed, scales, 4096), y)
        finally:
            lib.set_group_rows(group_rows)
    finally:
        lib.set_threads(before)


def test_q8_paths_agree(lib: RowsGemm) -> None:
    """Every compiled int8 path (AVX-512 VNNI, AVX2, portable C) gives the same floats without a
    bias: the same integer sums, scaled in the same order. Each build against the portable C
    one (the scalar build against the native one)."""
    other = load_rows_gemm("native" if lib.isa == "scalar" else "scalar")
    assert other is not None and other.q8_isa != lib.q8_isa
    g = torch.Generator().manual_seed(11)
    for k, n in Q8_PACK_SHAPES:
        packed, scales = lib.pack_q8(torch.randn(k, n, generator=g))
        for m in (1, 5, 8, 17):
            x = torch.randn(m, k, generator=g)
            assert torch.equal(
                lib.matmul_q8(x, packed, scales, n), other.matmul_q8(x, packed, scales, n)
            ), (k, n, m)


def test_q8_path_follows_the_cpu(lib: RowsGemm) -> None:
    """The int8 product takes AVX-512 VNNI where the AVX-512 build runs on a CPU that has it,
    else AVX2 on the vector builds, and portable C in the scalar one."""
    with open("/proc/cpuinfo") as f:
        vnni = any(ln.startswith("flags") and " avx512_vnni" in ln for ln in f)
    expected = {"avx512": "avx512-vnni" if vnni else "avx2", "avx2": "avx2", "scalar": "scalar"}
    assert lib.q8_isa == expected[lib.isa]


def test_default_rows_per_pass(lib: RowsGemm) -> None:
    """One pass over the weights serves up to 14 rows on AVX-512 (tiles of 2 panels up to 14
    rows), 6 on AVX2 and 4 in portable C."""
    assert lib.group_rows == {"avx512": 14, "avx2": 6, "scalar": 4}[lib.isa]


def thp_mode() -> str | None:
    """Linux's transparent-huge-page mode ("always", "madvise", "never"), or None."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text.split("[")[1].split("]")[0] if "[" in text else None


def anon_huge_kib(address: int) -> int:
    """AnonHugePages (KiB) of this process's mapping that holds `address`, per /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError("address not mapped")


def test_packed_weights_on_huge_pages() -> None:
    lib = load_rows_gemm()
    assert lib is not None
    k, n = 576, 4096  # 9 MiB packed
    wt = torch.randn(k, n, generator=torch.Generator().manual_seed(1))
    packed = lib.pack(wt)
    x = torch.randn(3, k)
    assert rel_err(lib.matmul(x, packed, n), x.double() @ wt.double()) < 1e-5
    small = lib.pack(torch.randn(64, 96))  # below HUGE_PAGE_MIN_BYTES: torch.zeros
    assert small.shape == (6, 64, 16)
    if thp_mode() not in ("always", "madvise"):
        pytest.skip("transparent huge pages are off on this host")
    assert anon_huge_kib(packed.data_ptr()) >= 2048
