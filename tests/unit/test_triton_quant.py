"""The Triton kernels of quantized linear layers (engine/kernels/quant_triton.py) against
`engine.quant.reference.reference_linear`, under Triton's interpreter (tests/conftest.py sets
`TRITON_INTERPRET=1`; with `TRITON_INTERPRET=0` on a CUDA machine they run compiled).

Tolerance, per element, from the output's rounding: the kernels' integers and the reference's
are the same exact values, so what differs is fp32 summation order (a few units of 2**-24 of the
sums' magnitudes: `atol` is 1e-5 of the output's largest magnitude) and the rounding of the fp32
result to the output dtype: half a unit in the last place on CUDA (2**-11 relative in fp16,
2**-8 in bf16), a whole unit under the interpreter, whose fp32 -> bf16 conversion truncates.
`rtol` allows one unit: 2**-10 for fp16, 2**-7 for bf16.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.kernels import quant_triton
from engine.kernels.quant_triton import (
    build_quant_kernel_cuda,
    choose_tiles,
    quantize_activations,
)
from engine.kernels.quant_triton_kernels import (
    quant_linear_kernel,
    quantize_rows_kernel,
    reduce_splits_kernel,
)
from engine.quant.reference import quantize_rows, reference_linear
from engine.quant.weights import QuantizedWeight, pack_int4
from tests.unit.test_triton_attention import DEVICE, INTERPRETED
from tests.unit.test_triton_variants import variant_key

IN_FEATURES, OUT_FEATURES = 256, 80  # 80: a partial tile of 64 output columns
ROWS = (1, 3, 16, 40)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
RTOL = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 1e-5}


def random_weight(
    bits: int, group_size: int, asym: bool, perm: bool, seed: int, out: int = OUT_FEATURES
) -> QuantizedWeight:
    """Every integer value of the bit width, scales of a trained layer's order (1e-3 - 2e-2)."""
    gen = torch.Generator().manual_seed(seed)
    low, high = -(1 << (bits - 1)), 1 << (bits - 1)
    q = torch.randint(low, high, (out, IN_FEATURES), generator=gen, dtype=torch.int8)
    groups = IN_FEATURES // group_size
    return QuantizedWeight(
        bits=bits,
        group_size=group_size,
        qweight=(q if bits == 8 else pack_int4(q)).to(DEVICE),
        scales=(torch.rand(out, groups, generator=gen) * 0.019 + 0.001).to(DEVICE),
        zeros=(
            torch.randint(low, high, (out, groups), generator=gen, dtype=torch.int8).to(DEVICE)
            if asym
            else None
        ),
        perm=torch.randperm(IN_FEATURES, generator=gen).to(DEVICE) if perm else None,
    )


def assert_matches(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert y.dtype == dtype and y.shape == ref.shape
    scale = ref.abs().max().item()
    torch.testing.assert_close(y.float(), ref, rtol=RTOL[dtype], atol=1e-5 * scale)


CASES = [
    (bits, group, asym, perm, int8)
    for bits in (4, 8)
    for group in (32, 128, IN_FEATURES)
    for asym in (False, True)
    for perm in (False, True)
    for int8 in (False, True)
]


@pytest.mark.parametrize(
    ("bits", "group_size", "asym", "perm", "int8_activations"),
    CASES,
    ids=[
        f"{'w8a8' if i8 else 'a16'}-int{b}-g{'ch' if g == IN_FEATURES else g}"
        f"-{'asym' if a else 'sym'}{'-perm' if p else ''}"
        for b, g, a, p, i8 in CASES
    ],
)
def test_kernel_matches_reference(
    bits: int,
    group_size: int,
    asym: bool,
    perm: bool,
    int8_activations: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each case runs M = 1, 3, 16 and 40 (three row tiers); the dtype, the bias and split-K
    rotate over the cases so that every format meets each of them."""
    index = CASES.index((bits, group_size, asym, perm, int8_activations))
    dtype = DTYPES[(index // 2) % 3]
    with_bias = index % 4 < 2
    # Split K over up to 8 programs a tile (8 simulated SMs, any number of K blocks a split),
    # or never (1 SM).
    monkeypatch.setattr(quant_triton, "MIN_BLOCKS_PER_SPLIT", 1)
    num_sms = 8 if index % 3 else 1
    weight = random_weight(bits, group_size, asym, perm, seed=index)
    gen = torch.Generator().manual_seed(100 + index)
    bias = torch.randn(OUT_FEATURES, generator=gen).to(DEVICE) if with_bias else None
    kernel = build_quant_kernel_cuda(
        weight, bias, int8_activations=int8_activations, dtype=dtype, num_sms=num_sms
    )
    splits = {kernel.tiles(m).split_k for m in ROWS}
    assert splits == {1} if num_sms == 1 else max(splits) > 1
    for m in ROWS:
        x = torch.randn(m, IN_FEATURES, generator=gen).to(DEVICE, dtype)
        ref = reference_linear(x, weight, bias, int8_activations=int8_activations)
        assert_matches(kernel(x), ref, dtype)


@pytest.mark.parametrize("int8_activations", [False, True], ids=["a16", "w8a8"])
def test_prefill_rows_and_strided_input(int8_activations: bool) -> None:
    """Above 64 rows (the prefill tiles) and x as a strided, misaligned view of a wider buffer."""
    weight = random_weight(4, 128, True, True, seed=7, out=200)
    kernel = build_quant_kernel_cuda(
        weight, None, int8_activations=int8_activations, dtype=torch.float16
    )
    assert kernel.tiles(70).block_m == quant_triton.PREFILL_BLOCK_M
    wide = torch.randn(70, IN_FEATURES + 3).to(DEVICE, torch.float16)
    for x in (wide[:, :IN_FEATURES], wide[:, 1 : IN_FEATURES + 1], wide[:1, 3:]):
        ref = reference_linear(x, weight, int8_activations=int8_activations)
        assert_matches(kernel(x), ref, torch.float16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_activation_quantization_is_quantize_rows_bit_for_bit(dtype: torch.dtype) -> None:
    """Rows with exact halves after scaling (round half to even), a row of zeros, a row whose
    largest magnitude is negative, wide and narrow magnitudes; gathered through a permutation,
    read from a strided view."""
    gen = torch.Generator().manual_seed(3)
    k = 1088  # two iterations of the kernel's 1024-column loop, 17 groups of 64
    x = (
        torch.randn(6, k + 5, generator=gen)
        * torch.tensor([1.0, 1e-3, 50.0, 1.0, 1.0, 1.0])[:, None]
    )
    x[3] = 0.0
    x[4, :8] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 126.5, -3.5])
    x[4, 8:] = 0.25
    x[5, 0] = -300.0
    view = x.to(DEVICE, dtype)[:, 2 : k + 2]  # row stride k + 5, offset 2 elements
    perm = torch.randperm(k, generator=gen).to(DEVICE)
    for p in (None, perm):
        xq, scales = quantize_activations(view, p)
        want_q, want_scales = quantize_rows(view if p is None else view[:, p], 64)
        assert torch.equal(scales, want_scales)
        assert torch.equal(xq, want_q)
    assert xq[3].abs().max() == 0 and bool((scales[3] == 0).all())


@pytest.mark.parametrize("bits", [4, 8])
def test_k_major_packing_holds_each_value_in_its_bits(bits: int) -> None:
    """Word [i, o] holds q[o, i * PACK + j] as a two's complement field at bit `bits * j`,
    including both extremes of the range (the top field's sign bit is the word's)."""
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    weight = random_weight(bits, 32, False, False, seed=5)
    q = weight.int_values().clone()
    q[0], q[1] = low, high
    weight = QuantizedWeight(bits, 32, q if bits == 8 else pack_int4(q), weight.scales, None, None)
    words = quant_triton.pack_k_major(weight).cpu().to(torch.int64) & 0xFFFFFFFF
    pack = 32 // bits
    for j in range(pack):
        field = (words >> (bits * j)) & ((1 << bits) - 1)
        field = torch.where(field > high, field - (1 << bits), field)
        assert torch.equal(field, q.T[j::pack].cpu().to(torch.int64)), j


@pytest.mark.parametrize(("bits", "asym", "perm"), [(4, True, True), (8, False, False)])
def test_unpack_gives_back_the_weight(bits: int, asym: bool, perm: bool) -> None:
    """The kernel's copy is the layer's only one: it unpacks to the weight it was built from."""
    weight = random_weight(bits, 32, asym, perm, seed=3)
    kernel = build_quant_kernel_cuda(weight, None, int8_activations=False, dtype=torch.float16)
    got = kernel.unpack()
    assert (got.bits, got.group_size) == (weight.bits, weight.group_size)
    for a, b in ((got.qweight, weight.qweight), (got.scales, weight.scales),
                 (got.zeros, weight.zeros), (got.perm, weight.perm)):  # fmt: skip
        assert (a is None) == (b is None)
        assert a is None or b is None or (a.dtype == b.dtype and torch.equal(a, b))


def test_unsupported_group_size_is_refused() -> None:
    weight = QuantizedWeight(
        8, 8, torch.zeros(4, 16, dtype=torch.int8), torch.ones(4, 2), None, None
    )
    with pytest.raises(ValueError, match="group size 8"):
        build_quant_kernel_cuda(weight, None, int8_activations=False, dtype=torch.float16)


def test_decode_grids_fill_an_h100_at_13b_shapes() -> None:
    """Batch-1 decode of each 13B product (qkv, o, gate_up, down; GPTQ groups of 128) gives
    every one of 132 multiprocessors two programs, splitting K where the column tiles do not."""
    for n, k in ((15360, 5120), (5120, 5120), (27648, 5120), (5120, 13824)):
        t = choose_tiles(1, n, k, 128, 132)
        programs = -(-n // t.block_n) * t.split_k
        assert programs >= 2 * 132, (n, k, t)
        assert t.split_k == 1 or -(-n // t.block_n) * t.split_k // 2 < 2 * 132, (n, k, t)


# ---------------------------------------------------------------- no compile while serving

KERNELS = {
    "quant_linear": quant_linear_kernel,
    "reduce_splits": reduce_splits_kernel,
    "quantize_rows": quantize_rows_kernel,
}
Launch = tuple[str, tuple[Any, ...], dict[str, Any]]


def record(monkeypatch: pytest.MonkeyPatch, launches: list[Launch]) -> None:
    for name, kernel in KERNELS.items():

        def recorded(*args: Any, _name: str = name, _run: Any = kernel.run, **kwargs: Any) -> Any:
            options = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
            launches.append((_name, args, options))
            return _run(*args, **kwargs)

        monkeypatch.setattr(kernel, "run", recorded)


def compiled_variants() -> int:
    """Variants Triton has compiled of these kernels on CUDA (none in the interpreter)."""
    if INTERPRETED:
        return 0
    return sum(len(c[0]) for k in KERNELS.values() for c in k.device_caches.values())


def keys(launches: list[Launch], honour: bool = True) -> set[tuple[str, str]]:
    return {(n, variant_key(KERNELS[n], a, k, honour_lists=honour)) for n, a, k in launches}


def test_serving_needs_no_variant_the_warm_up_did_not_make(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`warm_up(max_rows)` launches every variant that calls of up to `max_rows` rows need:
    any row count, inputs that are strided or misaligned views of a step buffer."""
    monkeypatch.setattr(quant_triton, "MIN_BLOCKS_PER_SPLIT", 1)
    layers = [
        build_quant_kernel_cuda(
            random_weight(4, 32, True, True, seed=1), torch.ones(OUT_FEATURES).to(DEVICE),
            int8_activations=False, dtype=torch.float16, num_sms=8,
        ),
        build_quant_kernel_cuda(
            random_weight(8, IN_FEATURES, False, False, seed=2), None,
            int8_activations=True, dtype=torch.float16, num_sms=8,
        ),
        build_quant_kernel_cuda(
            random_weight(8, 128, False, False, seed=3), None,
            int8_activations=False, dtype=torch.float16, num_sms=8,
        ),
    ]  # fmt: skip
    max_rows = 80
    warm_launches: list[Launch] = []
    with monkeypatch.context() as patch:
        record(patch, warm_launches)
        calls = sum(layer.warm_up(max_rows) for layer in layers)
    warm = keys(warm_launches)
    assert calls == sum(n == "quant_linear" for n, _, _ in warm_launches)
    assert {n for n, _ in warm} == set(KERNELS)

    buffer = torch.randn(max_rows + 1, 2 * IN_FEATURES + 1).to(DEVICE, torch.float16)
    serving: list[Launch] = []
    compiled = compiled_variants()
    with monkeypatch.context() as patch:
        record(patch, serving)
        for layer in layers:
            for m in (1, 2, 17, 40, 65, 80):
                layer(buffer[:m, :IN_FEATURES])
                layer(buffer[1 : m + 1, 1 : IN_FEATURES + 1])  # 2 bytes off 16
                layer(buffer[m, IN_FEATURES:-1][None])  # one row, at an offset
    assert {a[7] for n, a, _ in serving if n == "quant_linear"} >= {
        1,
        2,
        17,
        80,
    }  # M: 1, odd, a multiple of 16
    assert keys(serving) <= warm
    assert compiled_variants() == compiled  # on CUDA: Triton's own cache did not grow
    # Specializing every integer (M = 1, M divisible by 16) and alignment would compile anew.
    assert not keys(serving, honour=False) <= keys(warm_launches, honour=False)
