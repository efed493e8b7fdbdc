"""Linear layer whose storage layout and matrix kernel are private and chosen by measurement.

On CPU the weight is stored transposed, ``W^T`` as ``[in, out]`` contiguous: OpenBLAS and
onnxruntime's MLAS read that layout fastest (OpenBLAS M=1 on the lm_head: 4.6 ms vs 8.5 ms on
``[out, in]``); oneDNN and MKL read it as a transposed view, about as fast as ``[out, in]``.
On CUDA the weight is stored ``[out, in]`` and ``forward`` is plain ``F.linear``.

Kernels are functions ``x [M, in] -> y [M, out]`` bound to one layer's tensors. ``select_kernels``
times every candidate per distinct layer shape and per M bucket, rejects any kernel whose result is
not fp32-exact against a float64 reference, and installs the fastest per bucket in each layer.
``forward`` then costs one tuple lookup plus the kernel.

Inference only: inputs must not require grad. A layer is not safe for concurrent ``forward`` calls
from several threads (the MLAS kernel reuses one onnxruntime binding per layer). The placement and
dtype are fixed at construction: the weights are plain tensor attributes, so ``Module.to`` leaves
them alone.
"""

from __future__ import annotations

import ctypes
import glob
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

KernelFn = Callable[[torch.Tensor], torch.Tensor]
DEFAULT_M_VALUES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)


class Linear(torch.nn.Module):
    """y = x @ W^T + b. W is [out_features, in_features] logically (HF layout); the storage
    layout and the kernel are private.

    Until ``select_kernels`` runs, CPU fp32 layers use OpenBLAS (1 thread) for M = 1 and oneDNN
    above, the usual winners on a 2-core EPYC; other dtypes and devices use ``F.linear``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.dtype = dtype
        self.device = torch.device(device)
        # CPU: W^T [in, out] contiguous. Elsewhere: W [out, in] contiguous.
        self.transposed = self.device.type == "cpu"
        shape = (in_features, out_features) if self.transposed else (out_features, in_features)
        self.storage = torch.zeros(shape, dtype=dtype, device=self.device)
        self.bias: torch.Tensor | None = (
            torch.zeros(out_features, dtype=dtype, device=self.device) if bias else None
        )
        self.kernel_names: dict[int, str] = {}  # M bucket -> kernel name, for reports
        self._by_m: tuple[KernelFn, ...] = ()  # index M -> kernel, for M < len(_by_m)
        self._large: KernelFn = _build_torch(self, {})  # for M >= len(_by_m)
        if self.transposed and dtype == torch.float32:
            shared: dict[Any, Any] = {}
            self.install({m: (name, build(self, shared)) for m, name, build in _CPU_DEFAULT})
        else:
            self.install({1: ("torch", self._large)})

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, dtype={self.dtype}, kernels={self.kernel_names}"
        )

    def weight_view(self) -> torch.Tensor:
        """W as an [out, in] view of the storage (a transposed, non-contiguous view on CPU)."""
        return self.storage.t() if self.transposed else self.storage

    def load_rows(self, row_offset: int, weight: torch.Tensor) -> None:
        """Copy ``weight`` [rows, in] (HF layout, any float dtype/device) into logical rows
        [row_offset, row_offset + rows) of W, converting dtype in the same pass (no full-size
        temporary).

        Raises ValueError naming the expected and actual shapes if it does not fit.
        """
        rows = weight.shape[0] if weight.dim() == 2 else -1
        if weight.dim() != 2 or weight.shape[1] != self.in_features or row_offset < 0:
            raise ValueError(
                f"load_rows: expected a [rows, {self.in_features}] weight at row_offset >= 0, "
                f"got shape {list(weight.shape)} at row_offset {row_offset}"
            )
        if row_offset + rows > self.out_features:
            raise ValueError(
                f"load_rows: rows [{row_offset}, {row_offset + rows}) of shape "
                f"{list(weight.shape)} exceed W's shape [{self.out_features}, {self.in_features}]"
            )
        with torch.no_grad():
            self.weight_view()[row_offset : row_offset + rows].copy_(weight)

    def load_bias(self, row_offset: int, bias: torch.Tensor) -> None:
        """Copy ``bias`` [rows] into b[row_offset : row_offset + rows]; ValueError on mismatch."""
        if self.bias is None:
            raise ValueError("load_bias: this layer was built with bias=False")
        if bias.dim() != 1 or row_offset < 0 or row_offset + bias.shape[0] > self.out_features:
            raise ValueError(
                f"load_bias: expected a [rows] bias within [{self.out_features}] at row_offset "
                f">= 0, got shape {list(bias.shape)} at row_offset {row_offset}"
            )
        with torch.no_grad():
            self.bias[row_offset : row_offset + bias.shape[0]].copy_(bias)

    def embedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [N] int64 -> W[ids] [N, in_features] (contiguous), for tied embeddings."""
        if self.transposed:
            return self.storage.index_select(1, ids).t().contiguous()  # gather columns of W^T
        return self.storage.index_select(0, ids)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in_features] -> [M, out_features], same dtype and device as the layer."""
        m = x.shape[0]
        by_m = self._by_m
        return (by_m[m] if m < len(by_m) else self._large)(x)

    def install(self, plan: Mapping[int, tuple[str, KernelFn]]) -> None:
        """Install kernels: ``plan[bucket] = (name, fn)`` serves every M up to ``bucket`` that no
        smaller bucket serves; M above the largest bucket uses the largest bucket's kernel.
        M = 0 always goes to ``F.linear``.
        """
        buckets = sorted(plan)
        by_m = [_build_torch(self, {})]  # M = 0
        by_m += [plan[next(b for b in buckets if b >= m)][1] for m in range(1, buckets[-1] + 1)]
        self._by_m = tuple(by_m)
        self._large = plan[buckets[-1]][1]
        self.kernel_names = {b: plan[b][0] for b in buckets}


# ---------------------------------------------------------------------------------------------
# Kernel registry. ``build(layer, shared)`` returns a kernel bound to the layer's tensors;
# ``shared`` is a per-selection dict for objects reused across layers (onnxruntime sessions).


@dataclass(frozen=True)
class KernelSpec:
    name: str
    description: str
    supports: Callable[[Linear], bool]
    build: Callable[[Linear, dict[Any, Any]], KernelFn]


def _cpu_fp32(layer: Linear) -> bool:
    return layer.transposed and layer.dtype == torch.float32


def _build_torch(layer: Linear, shared: dict[Any, Any]) -> KernelFn:
    w, b = layer.weight_view(), layer.bias

    def run(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w, b)

    return run


def _build_onednn(layer: Linear, shared: dict[Any, Any]) -> KernelFn:
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


def _build_openblas(layer: Linear, shared: dict[Any, Any]) -> KernelFn:
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


def _build_mlas(layer: Linear, shared: dict[Any, Any]) -> KernelFn:
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
    # The C-level binding/session skip ~5 us of Python wrapper work per call.
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


def _has_onnxruntime(layer: Linear) -> bool:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return _cpu_fp32(layer)


# CPU fp32 plan before selection, (max M, kernel): the usual winners measured on a 2-core EPYC.
_CPU_DEFAULT = ((1, "openblas", _build_openblas), (2, "onednn", _build_onednn))


def _default_kernel(m: int) -> str:
    """The kernel `_CPU_DEFAULT` installs for M rows."""
    return next(name for first, name, _ in reversed(_CPU_DEFAULT) if m >= first)


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
    }
)


# ---------------------------------------------------------------------------------------------
# Selection.


@dataclass
class Timing:
    shape: tuple[int, int]  # (in, out)
    m: int
    kernel: str
    ms: float  # best per-call time (the warm-up call's if calls == 0)
    gbps: float  # weight bytes / best time
    rel_err: float  # relative Frobenius error vs float64; inf if the kernel raised
    exact: bool
    calls: int = 0  # timed calls after the warm-up; 0 = pruned (or inexact)


@dataclass
class KernelTable:
    """What ``select_kernels`` measured and chose. Holds the shared kernel resources."""

    timings: list[Timing] = field(default_factory=list)
    chosen: dict[tuple[int, int], dict[int, str]] = field(default_factory=dict)
    threads: int = 1
    seconds: float = 0.0
    shared: dict[Any, Any] = field(default_factory=dict, repr=False)

    def format(self) -> str:
        """A text table: ms per call (GB/s) for each kernel, shape and M; * marks the choice."""
        names = sorted({t.kernel for t in self.timings})
        lines = [f"{'shape':>12} {'M':>5} " + " ".join(f"{n:>17}" for n in names)]
        cells: dict[tuple[tuple[int, int], int], dict[str, Timing]] = {}
        for t in self.timings:
            cells.setdefault((t.shape, t.m), {})[t.kernel] = t
        for (shape, m), row in cells.items():
            out = []
            for n in names:
                c = row.get(n)
                mark = "*" if self.chosen.get(shape, {}).get(m) == n else " "
                if c is None or not c.exact or not c.calls:
                    text = "-" if c is None else "inexact" if not c.exact else "pruned"
                    out.append(f"{text:>16}{mark}")
                else:
                    out.append(f"{c.ms:8.3f} ({c.gbps:5.1f})".rjust(16) + mark)
            lines.append(f"{shape[0]:>5}->{shape[1]:<6} {m:>5} " + " ".join(out))
        return "\n".join(lines)


def _rel_err(layer: Linear, x: torch.Tensor, y: torch.Tensor) -> float:
    """Relative Frobenius error of y against float64 on up to ~256 sampled output columns."""
    n = layer.out_features
    ends = [torch.arange(min(n, 64)), torch.arange(max(0, n - 64), n)]  # tails, where bugs hide
    cols = torch.unique(torch.cat([*ends, torch.linspace(0, n - 1, 128).long()]))
    ref = x.double() @ layer.weight_view().index_select(0, cols).double().t()  # [M, cols]
    if layer.bias is not None:
        ref += layer.bias[cols].double()
    got = y[:, cols].double()
    if not bool(torch.isfinite(got).all()):
        return float("inf")
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


def _time_cell(
    layers: list[Linear],
    fns: dict[str, list[KernelFn]],
    x: torch.Tensor,
    rounds: int,
    target_s: float,
    prune: float,
) -> dict[str, Timing]:
    """Warm up and check every kernel on x, then time the exact ones in interleaved rounds."""
    k, n, m = layers[0].in_features, layers[0].out_features, x.shape[0]
    tol = 16 * torch.finfo(x.dtype).eps * k**0.5
    cells: dict[str, Timing] = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        try:
            y = fn[0](x)
        except Exception:  # a kernel that cannot run this case is never chosen for it
            cells[name] = Timing((k, n), m, name, 0.0, 0.0, float("inf"), False)
            continue
        first = time.perf_counter() - t0
        err = _rel_err(layers[0], x, y)
        cells[name] = Timing((k, n), m, name, first * 1e3, 0.0, err, err <= tol)
    for r in range(rounds):
        exact = [c for c in cells.values() if c.exact]
        fastest = min((c.ms for c in exact), default=0.0)
        for c in exact:
            if r and c.ms > prune * fastest:
                continue  # cannot win (warm-up times are not compared: they include set-up)
            calls = max(1, min(50, int(target_s * 1e3 / max(c.ms, 1e-3))))
            fn = fns[c.kernel]
            t0 = time.perf_counter()
            for i in range(calls):
                fn[i % len(fn)](x)  # next layer each call: weights come from memory
            c.ms = min(c.ms, (time.perf_counter() - t0) / calls * 1e3)
            c.calls += calls
    for c in cells.values():
        c.gbps = k * n * x.element_size() / c.ms / 1e6 if c.ms > 0 else 0.0
    return cells


def select_kernels(
    linears: Iterable[Linear],
    m_values: Sequence[int] = DEFAULT_M_VALUES,
    kernels: Sequence[str] | None = None,
    *,
    rounds: int = 3,
    target_s: float = 0.002,
    prune: float = 1.25,
    openblas_threads: int = 1,
    default_margin: float = 1.1,
) -> KernelTable:
    """Time each candidate kernel per distinct (in, out, dtype, bias) group and per M in
    ``m_values``; install the fastest exact one per M bucket in every layer of the group.

    Call after the weights are loaded. Timed calls rotate over the group's layers, so weights come
    from memory as in a real forward pass. A kernel is exact if its relative Frobenius error against
    a float64 reference (sampled columns) is <= 16 * eps(dtype) * sqrt(in_features); inexact
    kernels are never chosen. Each of ``rounds`` interleaved passes gives every candidate about
    ``target_s`` (1 to 50 calls); after the first pass a candidate slower than ``prune`` x the
    best so far is dropped. M above ``max(m_values)`` uses that bucket's choice.
    Non-CPU layers keep ``F.linear`` and are not timed.

    ``openblas_threads`` defaults to 1 on purpose: OpenBLAS workers spin-wait ~0.1 s after each
    call and starve torch's OpenMP threads (a 2-core decode step with OpenMP torch ops between
    2-thread OpenBLAS calls measured 25-40x slower); one thread runs OpenBLAS on the caller only.
    onnxruntime gets ``torch.get_num_threads()`` threads that do not spin.
    """
    t_start = time.perf_counter()
    table = KernelTable(threads=torch.get_num_threads())
    table.shared["openblas_threads"] = openblas_threads
    groups: dict[tuple[Any, ...], list[Linear]] = {}
    for layer in linears:
        if layer.transposed:
            key = (layer.in_features, layer.out_features, layer.dtype, layer.bias is not None)
            groups.setdefault(key, []).append(layer)
    gen = torch.Generator().manual_seed(0)
    for (k, n, dtype, _), layers in groups.items():
        names = [
            s.name for s in KERNELS.values()
            if (kernels is None or s.name in kernels) and s.supports(layers[0])
        ]  # fmt: skip
        fns = {name: [KERNELS[name].build(ly, table.shared) for ly in layers] for name in names}
        plan: dict[int, str] = {}
        for m in sorted(set(m_values)):
            x = torch.randn((m, k), generator=gen).to(dtype)
            cells = _time_cell(layers, fns, x, rounds, target_s, prune)
            table.timings.extend(cells.values())
            exact = [c for c in cells.values() if c.exact]
            best = min(exact, key=lambda c: c.ms) if exact else None
            default = cells.get(_default_kernel(m))
            if best is not None and default is not None and default.exact:
                plan[m] = default.kernel if default.ms <= default_margin * best.ms else best.kernel
            else:
                plan[m] = best.kernel if best is not None else "torch"
            if plan[m] not in fns:  # nothing exact: fall back to F.linear
                fns["torch"] = [_build_torch(ly, table.shared) for ly in layers]
        table.chosen[(k, n)] = plan
        for i, layer in enumerate(layers):
            layer.install({m: (name, fns[name][i]) for m, name in plan.items()})
    table.seconds = time.perf_counter() - t_start
    return table
