"""Matrix-product kernels for `engine.layers.linear.Linear`, and the rule for the default ones.

A kernel is a function ``x [M, in] -> y [M, out]`` bound to one layer's tensors.
``KERNELS[name].build(layer, shared)`` makes one; ``shared`` is a per-selection dict for settings
applied once for all layers (the "rows" kernel's thread count). ``supports(layer)`` says whether
a kernel can serve a layer at all; `engine.kernels.autotune` decides which one does.

Builders read the layer duck-typed (`MatmulLayer`), so this module does not import the layer.
On CPU the weight is stored transposed, ``W^T`` as ``[in, out]`` contiguous; ``F.linear`` (MKL)
reads it as a transposed ``[out, in]`` view.

The "rows" kernel (`engine/kernels/rows_gemm.c`: 1 to 16 rows a pass, up to `ROWS_MAX` rows;
``F.linear`` above) reads a copy of W^T packed into 16-column panels, made when the
kernel is built for a layer (at its first call for the default plan's, which is built before
the weights load) and made again at the next call after the layer's ``weights_version``
changes. For a gated layer whose halves are whole panels it packs (gate, up) pairs of panels
and is a `GatedKernel`: the SiLU-and-multiply runs on the products as the tiles finish them.
The copy exists only for layers where such a kernel has run or been built by selection and is
still referenced: it doubles those layers' weight memory, the price of reading each weight once
per call in the kernel's streaming order.

On CPU in bfloat16 (with AVX512_BF16 or AMX-BF16) the "onednn" kernel runs oneDNN's matmul on a
copy of W in oneDNN's blocked layout, made like the "rows" kernel's copy; "onednn-serial" runs
it on the calling thread alone, which start-up timing picks on a host whose cores are busy.

Kernels are for inference only: inputs must not require grad. A kernel is not safe for
concurrent calls from several threads (it may write to its layer's one output buffer).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from engine.kernels.buffers import OutputBuffer

KernelFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class GatedKernel:
    """A kernel of a gated layer (`MatmulLayer.gated`) that can also fuse the activation into
    the product: ``silu_and_mul(x)`` is silu(gate) * up [M, out / 2], or None for an M it
    does not fuse (the caller then applies its own to the product)."""

    product: KernelFn
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor | None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x)


class MatmulLayer(Protocol):
    """What a kernel builder reads of a layer (`Linear` provides it)."""

    in_features: int
    out_features: int
    dtype: torch.dtype
    transposed: bool  # storage is W^T [in, out] (CPU) rather than W [out, in]
    storage: torch.Tensor
    bias: torch.Tensor | None  # [out]
    weights_version: int  # changes whenever the weights or the bias are written
    gated: bool  # the output features are a gated activation's gate, then its up projection
    output: OutputBuffer | None  # memory a kernel may return its result in (buffers.py)

    def weight_view(self) -> torch.Tensor:
        """W as an [out, in] view of the storage."""
        ...


@dataclass(frozen=True)
class KernelSpec:
    name: str
    description: str
    supports: Callable[[MatmulLayer], bool]
    build: Callable[[MatmulLayer, dict[Any, Any]], KernelFn]


def _cpu_fp32(layer: MatmulLayer) -> bool:
    return layer.transposed and layer.dtype == torch.float32


def _build_torch(layer: MatmulLayer, shared: dict[Any, Any]) -> KernelFn:
    w, b = layer.weight_view(), layer.bias

    def run(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w, b)

    return run


def torch_kernel(layer: MatmulLayer) -> KernelFn:
    """``F.linear`` bound to the layer: serves any dtype, device and M (M = 0 included)."""
    return _build_torch(layer, {})


ROWS_MAX = 64
"""The most rows the "rows" kernel computes itself (in row groups of at most its `group_rows`,
each later group reading a run of panels from cache); it hands larger products (prompt chunks)
to the "torch" kernel, MKL's blocked GEMM, which suits compute-bound shapes."""


def _rows_kernel(layer: MatmulLayer, shared: dict[Any, Any], *, lazy: bool) -> KernelFn:
    """The "rows" kernel on a packed copy of the layer's W^T: made now, or at the first call when
    ``lazy`` (so a kernel built before the weights load packs the loaded ones); made again at the
    next call whenever the layer's ``weights_version`` has changed since. Above `ROWS_MAX` rows
    it runs ``F.linear`` on the layer's W^T instead. It writes its results to the layer's
    ``output`` buffer when the layer has one."""
    from engine.kernels.rows import load_rows_gemm

    lib = load_rows_gemm()
    if lib is None:
        raise RuntimeError("rows_gemm.c could not be built")
    n, output = layer.out_features, layer.output  # output None: new tensors each call
    pairs = layer.gated and n % (2 * lib.PANEL) == 0
    product = lib.matmul_pairs if pairs else lib.matmul  # y [M, out] in W^T's column order
    large = _build_torch(layer, shared)
    # [packed W^T [ceil(out/16), in, 16], padded bias [ceil(out/16) * 16] or None, weights_version]
    state: list[Any] = [None, None, -1]
    if "rows_threads" not in shared:  # process-wide setting, applied once per build batch
        # now, not at a lazy first call: that may run where torch is held to one thread
        shared["rows_threads"] = torch.get_num_threads()
        lib.set_threads(shared["rows_threads"])

    def pack() -> None:
        state[0] = (lib.pack_pairs if pairs else lib.pack)(layer.storage)
        bias = layer.bias
        state[1] = None if bias is None else (lib.pad_bias_pairs if pairs else lib.pad_bias)(bias)
        state[2] = layer.weights_version

    if not lazy:
        pack()

    def run(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > ROWS_MAX:
            return large(x)
        if state[2] != layer.weights_version:
            pack()
        out = None if output is None else output.take(x.shape[0], n)
        return product(x, state[0], n, state[1], out=out)  # [M, out]

    def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
        if x.shape[0] > ROWS_MAX:
            return None
        if state[2] != layer.weights_version:
            pack()
        out = None if output is None else output.take(x.shape[0], n // 2)
        return lib.matmul_pairs(x, state[0], n, state[1], silu=True, out=out)  # [M, out / 2]

    return GatedKernel(run, silu_and_mul) if pairs else run


_build_rows = functools.partial(_rows_kernel, lazy=False)
_build_rows_lazy = functools.partial(_rows_kernel, lazy=True)


def _onednn_kernel(
    layer: MatmulLayer, shared: dict[Any, Any], *, lazy: bool, serial: bool = False
) -> KernelFn:
    """oneDNN's matmul (AMX or AVX512_BF16 on bfloat16) on a copy of W in oneDNN's blocked
    layout, made now or at the first call when ``lazy``, and again at the next call after the
    layer's ``weights_version`` changes; any M. Products accumulate in float32 and round to the
    layer's dtype once. ``serial``: torch is held to one thread for the call (process-wide,
    restored after it), so the product runs on the calling thread alone."""
    threads = torch.get_num_threads()
    reorder = torch.ops.mkldnn._reorder_linear_weight
    linear = torch.ops.mkldnn._linear_pointwise
    state: list[Any] = [None, -1]  # [W in oneDNN's layout, weights_version]

    def pack() -> None:
        state[0] = reorder(layer.weight_view().contiguous(), None)
        state[1] = layer.weights_version

    if not lazy:
        pack()

    def run(x: torch.Tensor) -> torch.Tensor:
        if state[1] != layer.weights_version:
            pack()
        return linear(x.contiguous(), state[0], layer.bias, "none", [], "")

    def run_serial(x: torch.Tensor) -> torch.Tensor:
        torch.set_num_threads(1)
        try:
            return run(x)
        finally:
            torch.set_num_threads(threads)

    return run_serial if serial and threads > 1 else run


_build_onednn = functools.partial(_onednn_kernel, lazy=False)
_build_onednn_lazy = functools.partial(_onednn_kernel, lazy=True)
_build_onednn_serial = functools.partial(_onednn_kernel, lazy=False, serial=True)


@functools.cache
def _onednn_bf16_available() -> bool:
    """This torch has oneDNN's prepacked linear and the CPU multiplies bfloat16 in hardware."""
    from engine.kernels.cpu import native_bf16

    mkldnn = torch.ops.mkldnn
    try:
        ops = (mkldnn._reorder_linear_weight, mkldnn._linear_pointwise)
    except (AttributeError, RuntimeError):
        return False
    return bool(ops) and torch.backends.mkldnn.is_available() and native_bf16()


def _has_onednn_bf16(layer: MatmulLayer) -> bool:
    return (
        layer.transposed
        and layer.dtype == torch.bfloat16
        and layer.storage.device.type == "cpu"
        and _onednn_bf16_available()
    )


def _has_rows_gemm(layer: MatmulLayer) -> bool:
    if not (_cpu_fp32(layer) and layer.storage.device.type == "cpu"):
        return False
    from engine.kernels.rows import load_rows_gemm

    return load_rows_gemm() is not None


KERNELS: Mapping[str, KernelSpec] = MappingProxyType(
    {
        "torch": KernelSpec("torch", "F.linear (MKL on CPU)", lambda _: True, _build_torch),
        "rows": KernelSpec(
            "rows",
            "rows_gemm.c on packed W^T panels; F.linear above ROWS_MAX rows",
            _has_rows_gemm,
            _build_rows,
        ),
        "onednn": KernelSpec(
            "onednn",
            "oneDNN matmul on W prepacked in its blocked layout (CPU bfloat16 with AVX512_BF16 "
            "or AMX-BF16)",
            _has_onednn_bf16,
            _build_onednn,
        ),
        "onednn-serial": KernelSpec(
            "onednn-serial",
            "the onednn kernel on the calling thread alone: where waking the thread pool costs "
            "more than a decode-sized product (a host whose cores are busy)",
            _has_onednn_bf16,
            _build_onednn_serial,
        ),
    }
)


_Plan = tuple[tuple[int, str, Callable[[MatmulLayer, dict[Any, Any]], KernelFn]], ...]


def _cpu_default() -> _Plan:
    """CPU fp32 plan before selection, (largest M served, kernel; the last serves every larger
    M): the "rows" kernel streams each weight once for all rows of a decode or verify step;
    ``F.linear`` serves prefill-sized M, and every M without rows_gemm.c (no C compiler)."""
    from engine.kernels.rows import load_rows_gemm

    if load_rows_gemm() is None:
        return ((1, "torch", _build_torch),)
    return ((ROWS_MAX, "rows", _build_rows_lazy), (ROWS_MAX + 1, "torch", _build_torch))


def default_kernel(m: int) -> str:
    """The kernel `default_plan` installs for M rows of a CPU fp32 layer."""
    plan = _cpu_default()
    return next((name for last, name, _ in plan if m <= last), plan[-1][1])


def default_plan(layer: MatmulLayer) -> dict[int, tuple[str, KernelFn]]:
    """The kernels a layer uses until selection, as ``{M bucket: (name, kernel)}`` (bucket = the
    largest M it serves, the largest bucket serving every M above too): CPU fp32 layers get the
    "rows" kernel, packed at its first call, for M = 1 to 64 and ``F.linear`` above (for every
    M where rows_gemm.c cannot be built); CPU bfloat16 layers on a CPU with bfloat16
    instructions get the "onednn" kernel, packed at its first call, for every M; other dtypes
    and devices get ``F.linear`` for every M."""
    if _cpu_fp32(layer) and layer.storage.device.type == "cpu":
        shared: dict[Any, Any] = {}
        return {m: (name, build(layer, shared)) for m, name, build in _cpu_default()}
    if _has_onednn_bf16(layer):
        return {1: ("onednn", _build_onednn_lazy(layer, {}))}
    return {1: ("torch", torch_kernel(layer))}
