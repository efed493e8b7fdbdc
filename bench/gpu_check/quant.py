"""Section `quant`: the Triton kernels of quantized weights (engine/kernels/quant_triton.py) at
a Llama-2-13B decoder layer's products (hidden 5120, intermediate 13824: qkv 5120 -> 15360, o
5120 -> 5120, gate_up 5120 -> 27648, down 13824 -> 5120), random fp16 activations.

Formats: GPTQ 4-bit with groups of 128, asymmetric zeros and act-order (`gptq4_g128`, weight-only
W4A16), and int8 per output channel with int8 activations (`int8_w8a8`, the `QUANTIZE=int8`
product). For each:

- correctness at 16 rows, per product: the kernel against the exact reference
  (`engine.quant.reference.reference_linear`: the dequantized weights in fp32 for W4A16, the
  exact integer sums for W8A8), largest difference over the reference's largest magnitude,
  PASS within 2**-10 (one unit of fp16's last place); beside it (INFO) how far the dequantized
  fp16 product (`F.linear` with the dequantized weights in fp16) lies from that reference;
- time of the layer's four products at 1 row (decode) and 16 rows (a verify step), after the
  kernels' `warm_up`, replayed from a CUDA graph of ten such layers (the capture fails should a
  call synchronize), against the same four products in fp16 `F.linear` captured likewise and
  against the time the bytes the kernels read take at the measured copy bandwidth (INFO).

On CPU (`--device cpu`) the kernels run in Triton's interpreter at small shapes and eagerly;
the `quant.kernel_calls` check counts the calls that reached them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from bench.gpu_check.environment import BANDWIDTH
from bench.gpu_check.reach import counting
from bench.gpu_check.report import Ctx, status, timed

SHAPES_13B = {
    "qkv": (15360, 5120),
    "o": (5120, 5120),
    "gate_up": (27648, 5120),
    "down": (5120, 13824),
}
SHAPES_SMALL = {"qkv": (384, 128), "o": (128, 128), "gate_up": (512, 128), "down": (128, 256)}
"""(out, in) of each product."""

FORMATS = {"gptq4_g128": (4, 128, False), "int8_w8a8": (8, None, True)}
"""(bits, group size or None for one scale per output row, int8 activations)."""

TOLERANCE = 2.0**-10
GRAPH_COPIES = 10
ROWS = (1, 16)


def random_weight(out: int, inp: int, bits: int, group: int | None, device: str) -> Any:
    """A `QuantizedWeight` of random integers: GPTQ's form (asymmetric zeros, act-order perm)
    for groups, symmetric per-channel int8 otherwise; scales that keep outputs near 1."""
    import torch

    from engine.quant.weights import QuantizedWeight, pack_int4

    low, high = -(1 << (bits - 1)), 1 << (bits - 1)
    q = torch.randint(low, high, (out, inp), dtype=torch.int8, device=device)
    group_size = group or inp
    groups = inp // group_size
    grouped = group is not None
    return QuantizedWeight(
        bits=bits,
        group_size=group_size,
        qweight=q if bits == 8 else pack_int4(q),
        scales=torch.rand(out, groups, device=device) * (0.002 if grouped else 0.0002) + 0.001,
        zeros=torch.randint(low, high, (out, groups), dtype=torch.int8, device=device)
        if grouped
        else None,
        perm=torch.randperm(inp, device=device) if grouped else None,
    )


def captured(ctx: Ctx, fn: Callable[[], object]) -> tuple[Callable[[], object], int]:
    """(a call, the number of `fn` calls it makes): on CUDA a CUDA graph of `GRAPH_COPIES` calls
    of `fn` (captured after one eager call), as a model's layers follow one another, so that a
    layer's weights are out of L2 when it is read again; `fn` itself off CUDA."""
    if not ctx.cuda:
        return fn, 1
    import torch

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_COPIES):
            fn()
    return graph.replay, GRAPH_COPIES


def section_quant(ctx: Ctx) -> None:
    import torch
    import torch.nn.functional as F

    from engine.kernels.quant_triton import TritonQuantLinear, build_quant_kernel_cuda
    from engine.quant.reference import reference_linear

    r = ctx.report
    small = ctx.small or not ctx.cuda
    shapes = SHAPES_SMALL if small else SHAPES_13B
    repeats = 1 if not ctx.cuda else 20
    r.detail("shapes", shapes)
    dtype = torch.float16
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    dense = {
        name: torch.randn(out, inp, device=ctx.device, generator=gen).to(dtype) * 0.02
        for name, (out, inp) in shapes.items()
    }
    rows = {m: {n: torch.randn(m, inp, device=ctx.device, generator=gen).to(dtype)
                for n, (_, inp) in shapes.items()} for m in ROWS}  # fmt: skip
    fp16_s: dict[int, float] = {}

    def time_layer(
        tag: str, products: Mapping[str, Callable[[torch.Tensor], torch.Tensor]], nbytes: int
    ) -> None:
        """The layer's products at each row count (INFO): time, and its ratio to fp16's and to
        the time the bytes read would take at the measured copy bandwidth."""
        r.check(f"quant.{tag}.layer_bytes", nbytes / 1e6, "MB", "INFO")
        bw = BANDWIDTH.get("GB/s")
        if bw:
            r.check(f"quant.{tag}.bandwidth_bound", nbytes / bw / 1e3, "us", "INFO")
        for m in ROWS:

            def layer(xs: dict[str, torch.Tensor] = rows[m]) -> object:
                return [f(xs[n]) for n, f in products.items()]

            step, copies = captured(ctx, layer)
            seconds = timed(ctx, step, repeats, warmup=1 if ctx.cuda else 0) / copies
            r.check(f"quant.{tag}.rows{m}.layer_time", seconds * 1e6, "us", "INFO")
            r.check(f"quant.{tag}.rows{m}.read_rate", nbytes / seconds / 1e9, "GB/s", "INFO")
            if bw:
                over = seconds / (nbytes / (bw * 1e9))
                r.check(f"quant.{tag}.rows{m}.over_bound", over, "x", "INFO")
            if tag == "fp16":
                fp16_s[m] = seconds
            elif m in fp16_s:
                r.check(f"quant.{tag}.rows{m}.speedup_vs_fp16", fp16_s[m] / seconds, "x", "INFO")

    def fp16_baseline() -> None:
        nbytes = sum(w.numel() * w.element_size() for w in dense.values())
        products = {n: functools.partial(F.linear, weight=w) for n, w in dense.items()}
        time_layer("fp16", products, nbytes)

    ctx.step("quant.fp16", fp16_baseline, min_left=3)

    with counting({"kernel_calls": (TritonQuantLinear, "__call__")}) as calls:
        for fmt, (bits, group, int8_act) in FORMATS.items():

            def run_format(fmt: str = fmt, bits: int = bits, group: int | None = group,
                           int8_act: bool = int8_act) -> None:  # fmt: skip
                kernels: dict[str, TritonQuantLinear] = {}
                nbytes = 0
                for name, (out, inp) in shapes.items():
                    weight = random_weight(out, inp, bits, group, ctx.device)
                    kernel = build_quant_kernel_cuda(
                        weight, None, int8_activations=int8_act, dtype=dtype
                    )
                    kernel.warm_up(max(ROWS))
                    kernels[name] = kernel
                    nbytes += sum(
                        t.numel() * t.element_size()
                        for t in (kernel.words, kernel.scales, kernel.zeros, kernel.perm)
                        if t is not None
                    )
                    x = rows[max(ROWS)][name]
                    ref = reference_linear(x, weight, int8_activations=int8_act)
                    top = ref.abs().max().item()
                    error = (kernel(x).float() - ref).abs().max().item() / top
                    product = F.linear(x, weight.dequantize(dtype)).float()
                    product_error = (product - ref).abs().max().item() / top
                    tag = f"quant.{fmt}.{name}"
                    r.check(f"{tag}.max_error", error, "rel", status(error <= TOLERANCE))
                    r.check(f"{tag}.fp16_product_error", product_error, "rel", "INFO")
                    del weight, ref, product
                time_layer(fmt, dict(kernels), nbytes)

            ctx.step(f"quant.{fmt}", run_format, min_left=5)
    launches = calls["kernel_calls"]
    r.check("quant.kernel_calls", launches, "calls", status(launches > 0))
