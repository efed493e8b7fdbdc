"""Matrix-product kernels for `engine.layers.linear.Linear`, and the rule for the default ones.

A kernel is a function ``x [M, in] -> y [M, out]`` bound to one layer's tensors.
``KERNELS[name].build(layer, shared)`` makes one; ``shared`` is a per-selection dict for objects
reused across layers (the onnxruntime session, the OpenBLAS thread setting). ``supports(layer)``
says whether a kernel can serve a layer at all; `engine.kernels.autotune` decides which one does.

Builders read the layer duck-typed (`MatmulLayer`), so this module does not import the layer.
On CPU the weight is stored transposed, ``W^T`` as ``[in, out]`` contiguous: OpenBLAS and
onnxruntime's MLAS read that layout fastest; oneDNN and MKL read it as a transposed ``[out, in]``
view.

The "rows" kernel (`engine/kernels/rows_gemm.c`: 1 to 16 rows a pass, up to `ROWS_MAX` rows; oneDNN
above) reads a copy of W^T packed into 16-column panels, made when the kernel is built for a
layer (at its first call for the default plan's, which is built before the weights load) and
made again at the next call after the layer's ``weights_version`` changes. For a gated layer
whose halves are whole panels it packs (gate, up) pairs of panels and is a `GatedKernel`: the
SiLU-and-multiply runs on the products as the tiles finish them. The copy exists only
for layers where such a kernel has run or been built by selection and is still referenced: it
doubles those layers' weight memory, the price of reading each weight once per call in the
kernel's streaming order.

Kernels are for inference only: inputs must not require grad. A kernel is not safe for
concurrent calls from several threads (the MLAS kernel reuses one onnxruntime binding per layer).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np
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


def _build_onednn(layer: MatmulLayer, shared: dict[Any, Any]) -> KernelFn:
    w, b = layer.weight_view(), layer.bias  # oneDNN reads the [out, in] strided view in place
    op = torch.ops.mkldnn._linear_pointwise

    def run(x: torch.Tensor) -> torch.Tensor:
        return op(x, w, b, "none", [], "")

    return run


def _openblas_lib() -> ctypes.CDLL | None:
    """numpy's bundled OpenBLAS (already loaded by numpy, so this returns the same instance)."""
    root = os.path.dirname(os.path.dirname(np.__file__))
    for pattern in ("numpy.libs/*openblas*.so*", "numpy/.libs/*openblas*.so*"):
        for path in sorted(glob.glob(os.path.join(root, pattern))):
            return ctypes.CDLL(path)
    return None


def set_openblas_threads(n: int) -> bool:
    """Set numpy's OpenBLAS thread count; returns False if the library was not found."""
    lib = _openblas_lib()
    for sym in ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_",
                "scipy_openblas_set_num_threads", "openblas_set_num_threads"):  # fmt: skip
        fn = getattr(lib, sym, None) if lib is not None else None
        if fn is not None:
            fn.argtypes = [ctypes.c_int]
            fn(n)
            return True
    return False


def _build_openblas(layer: MatmulLayer, shared: dict[Any, Any]) -> KernelFn:
    if "openblas_ok" not in shared:  # process-wide setting, applied once per build batch
        shared["openblas_ok"] = set_openblas_threads(shared.setdefault("openblas_threads", 1))
    wt = layer.storage.numpy()  # W^T [in, out], zero-copy view of the torch storage
    n, b, matmul = layer.out_features, layer.bias, np.matmul

    def run(x: torch.Tensor) -> torch.Tensor:
        y = torch.empty((x.shape[0], n), dtype=torch.float32)  # [M, out]
        matmul(x.numpy(), wt, out=y.numpy())
        return y if b is None else y.add_(b)

    return run


def _onnx_matmul_model() -> bytes:
    """Serialized ONNX model y[M, N] = MatMul(x[M, K], w[K, N]) with symbolic dims, so one session
    (and one thread pool) serves every shape. Encoded by hand: no dependency on the onnx package."""

    def varint(v: int) -> bytes:
        out = bytearray()
        while v > 0x7F:
            out.append((v & 0x7F) | 0x80)
            v >>= 7
        return bytes([*out, v])

    def fld(num: int, payload: bytes | str | int) -> bytes:  # protobuf field: varint or bytes
        if isinstance(payload, int):
            return varint(num << 3) + varint(payload)
        data = payload.encode() if isinstance(payload, str) else payload
        return varint(num << 3 | 2) + varint(len(data)) + data

    def value_info(name: str, dims: Sequence[str]) -> bytes:  # float tensor with named dims
        shape = b"".join(fld(1, fld(2, d)) for d in dims)
        return fld(1, name) + fld(2, fld(1, fld(1, 1) + fld(2, shape)))

    node = fld(1, "x") + fld(1, "w") + fld(2, "y") + fld(4, "MatMul")
    graph = (
        fld(1, node) + fld(2, "linear") + fld(11, value_info("x", "MK"))
        + fld(11, value_info("w", "KN")) + fld(12, value_info("y", "MN"))
    )  # fmt: skip
    return fld(1, 8) + fld(8, fld(1, "") + fld(2, 17)) + fld(7, graph)  # ir_version 8, opset 17


def _build_mlas(layer: MatmulLayer, shared: dict[Any, Any]) -> KernelFn:
    import onnxruntime as ort
    from onnxruntime.capi import _pybind_state as ort_c

    if "mlas" not in shared:  # one session for all layers; weights are bound per layer, not copied
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = shared.get("mlas_threads", torch.get_num_threads())
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        # Idle workers sleep at once: spinning ones starve torch's OpenMP threads on small hosts.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        shared["mlas"] = ort.InferenceSession(_onnx_matmul_model(), opts, ["CPUExecutionProvider"])
    sess = shared["mlas"]
    k, n, w, b = layer.in_features, layer.out_features, layer.storage, layer.bias
    # The C-level binding and session skip the Python wrappers' work on every call.
    binding, csess, run_opts = sess.io_binding()._iobinding, sess._sess, ort_c.RunOptions()
    dev = ort_c.OrtDevice(ort_c.OrtDevice.cpu(), ort_c.OrtDevice.default_memory(), 0)
    f32 = np.dtype(np.float32)
    binding.bind_input("w", dev, f32, [k, n], w.data_ptr())  # W^T [in, out]; `w` kept alive below

    def run(x: torch.Tensor, _keep: torch.Tensor = w) -> torch.Tensor:
        x = x.contiguous()
        m = x.shape[0]
        y = torch.empty((m, n), dtype=torch.float32)  # [M, out]
        binding.bind_input("x", dev, f32, [m, k], x.data_ptr())
        binding.bind_output("y", dev, f32, [m, n], y.data_ptr())
        csess.run_with_iobinding(binding, run_opts)
        return y if b is None else y.add_(b)

    return run


ROWS_MAX = 64
"""The most rows the "rows" kernel computes itself (in row groups of at most its `group_rows`,
each later group reading a run of panels from cache); it hands larger products (prompts) to
oneDNN, whose blocked kernels suit compute-bound shapes."""


def _rows_kernel(layer: MatmulLayer, shared: dict[Any, Any], *, lazy: bool) -> KernelFn:
    """The "rows" kernel on a packed copy of the layer's W^T: made now, or at the first call when
    ``lazy`` (so a kernel built before the weights load packs the loaded ones); made again at the
    next call whenever the layer's ``weights_version`` has changed since. Above `ROWS_MAX` rows
    it runs oneDNN (``F.linear`` where oneDNN is unavailable) on the layer's W^T instead. It
    writes its results to the layer's ``output`` buffer when the layer has one."""
    from engine.kernels.rows import load_rows_gemm

    lib = load_rows_gemm()
    if lib is None:
        raise RuntimeError("rows_gemm.c could not be built")
    n, output = layer.out_features, layer.output  # output None: new tensors each call
    pairs = layer.gated and n % (2 * lib.PANEL) == 0
    product = lib.matmul_pairs if pairs else lib.matmul  # y [M, out] in W^T's column order
    onednn = layer.dtype == torch.float32 and torch.backends.mkldnn.is_available()
    large = (_build_onednn if onednn else _build_torch)(layer, shared)
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


def _has_rows_gemm(layer: MatmulLayer) -> bool:
    if not (_cpu_fp32(layer) and layer.storage.device.type == "cpu"):
        return False
    from engine.kernels.rows import load_rows_gemm

    return load_rows_gemm() is not None


def _has_onnxruntime(layer: MatmulLayer) -> bool:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return _cpu_fp32(layer)


KERNELS: Mapping[str, KernelSpec] = MappingProxyType(
    {
        "torch": KernelSpec("torch", "F.linear (MKL on CPU)", lambda _: True, _build_torch),
        "onednn": KernelSpec(
            "onednn",
            "torch.ops.mkldnn._linear_pointwise",
            lambda ly: (
                ly.transposed
                and ly.dtype in (torch.float32, torch.bfloat16)
                and torch.backends.mkldnn.is_available()
            ),
            _build_onednn,
        ),
        "openblas": KernelSpec(
            "openblas", "numpy matmul (OpenBLAS) on W^T", _cpu_fp32, _build_openblas
        ),
        "mlas": KernelSpec(
            "mlas", "onnxruntime MatMul (MLAS) on W^T", _has_onnxruntime, _build_mlas
        ),
        "rows": KernelSpec(
            "rows",
            "rows_gemm.c on packed W^T panels (torch.get_num_threads() threads); oneDNN above 64",
            _has_rows_gemm,
            _build_rows,
        ),
    }
)


# CPU fp32 plan before selection, (largest M served, kernel; the last serves every larger M): the
# "rows" kernel streams each weight once for all rows of a decode or verify step; oneDNN serves
# prefill-sized M. Without rows_gemm.c (no C compiler) OpenBLAS serves M = 1 instead.
_CPU_DEFAULT = ((ROWS_MAX, "rows", _build_rows_lazy), (ROWS_MAX + 1, "onednn", _build_onednn))
_CPU_FALLBACK = ((1, "openblas", _build_openblas), (2, "onednn", _build_onednn))


_Plan = tuple[tuple[int, str, Callable[[MatmulLayer, dict[Any, Any]], KernelFn]], ...]


def _cpu_default() -> _Plan:
    from engine.kernels.rows import load_rows_gemm

    return _CPU_DEFAULT if load_rows_gemm() is not None else _CPU_FALLBACK


def default_kernel(m: int) -> str:
    """The kernel `default_plan` installs for M rows of a CPU fp32 layer."""
    plan = _cpu_default()
    return next((name for last, name, _ in plan if m <= last), plan[-1][1])


def default_plan(layer: MatmulLayer) -> dict[int, tuple[str, KernelFn]]:
    """The kernels a layer uses until selection, as ``{M bucket: (name, kernel)}`` (bucket = the
    largest M it serves, the largest bucket serving every M above too): CPU fp32 layers get the
    "rows" kernel, packed at its first call, for M = 1 to 64 and oneDNN above (OpenBLAS, 1
    thread, for M = 1 and oneDNN above where rows_gemm.c cannot be built); other dtypes and
    devices get ``F.linear`` for every M."""
    if _cpu_fp32(layer) and layer.storage.device.type == "cpu":
        shared: dict[Any, Any] = {}
        return {m: (name, build(layer, shared)) for m, name, build in _cpu_default()}
    return {1: ("torch", torch_kernel(layer))}
