"""ctypes bindings of the C kernels: `cpu_kernels.c`, fused float32 CPU kernels for the decoder's
glue and for attention over the paged KV cache, and `rows_gemm.c`, a float32 matrix product for
few rows (`RowsGemm`, served as the "rows" linear kernel by `engine.kernels.matmul`).

Each C file is compiled on first use with the system C compiler (`$CC`, else `cc`) for this CPU
(`-march=native`) into `$SPECSERVE_HOME/kernels/`, keyed by the source, the flags and the CPU, so
a later process loads it without compiling (`load_library`). Without a compiler
`load_cpu_kernels` returns None and the model runs the same maths as ATen ops
(`engine/models/llama.py`, `TorchAttentionBackend`); `load_rows_gemm` returns None and the "rows"
kernel is not offered.

Why: op by op in ATen, the glue between a layer's matrix products is many small ops, each paying
a dispatch cost larger than its arithmetic on decode-sized tensors. These kernels make that glue 4
calls per layer and read the paged cache in place instead of gathering it.

Contract of every method: float32 CPU tensors whose last dimension is contiguous; other strides
as stated. Outputs are new contiguous tensors unless the method name ends in `_`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from engine.paths import specserve_home

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
ROWS_SOURCE = Path(__file__).with_name("rows_gemm.c")
CFLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fPIC", "-shared")
# Extra flags per `load_rows_gemm` variant: its instruction-set path is chosen at compile time.
ROWS_VARIANTS: dict[str, tuple[str, ...]] = {
    "native": ("-pthread",),
    "avx2": ("-pthread", "-mno-avx512f"),
    "scalar": ("-pthread", "-DSPECSERVE_SCALAR"),
}

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float
_SIGNATURES: dict[str, list[Any]] = {
    "rms_norm": [_P, _I, _P, _P, _I, _I, _F],
    "add_rms_norm": [_P, _I, _P, _P, _P, _I, _I, _F],
    "silu_and_mul": [_P, _P, _I, _I],
    "rope": [_P, _I, _I, _I, _P, _P, _I],
    "store_and_attend": [_P, _I, _P, _P, _I, _P, _P, _P, _P, _I, _I, _P, _P, _P, _P, _P]
    + [_I] * 5
    + [_F],
    "speculator_stage": [_P, _I, _P, _I, _I, _P, _F, _P, _P, _F, _P, _I],
    "log_softmax_topk": [_P, _I, _I, _I, _P, _P],
}


class CpuKernels:
    """The loaded library's functions, with tensor-level wrappers."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = None
        self._rms_norm = lib.rms_norm
        self._add_rms_norm = lib.add_rms_norm
        self._silu_and_mul = lib.silu_and_mul
        self._rope = lib.rope
        self.store_and_attend = lib.store_and_attend  # called by CpuAttentionBackend
        self._speculator_stage = lib.speculator_stage
        self._log_softmax_topk = lib.log_softmax_topk

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [N, d] (any row stride) -> x * rsqrt(mean(x^2) + eps) * weight, [N, d]."""
        n, d = x.shape
        out = torch.empty(n, d, dtype=torch.float32)
        self._rms_norm(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), n, d, eps)
        return out

    def add_rms_norm_(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """residual += x in place (residual [N, d] contiguous, x any row stride); returns
        rms_norm(residual) as a new [N, d] tensor."""
        n, d = residual.shape
        out = torch.empty(n, d, dtype=torch.float32)
        self._add_rms_norm(
            x.data_ptr(), x.stride(0), residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
            n, d, eps,
        )  # fmt: skip
        return out

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [N, 2d] contiguous -> silu(gate) * up, [N, d]."""
        n, d = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(n, d, dtype=torch.float32)
        self._silu_and_mul(gate_up.data_ptr(), out.data_ptr(), n, d)
        return out

    def rope_(
        self,
        x: torch.Tensor,  # [N, >= num_heads * head_dim], any row stride
        num_heads: int,
        head_dim: int,
        cos_sin: torch.Tensor,  # [P, 2, head_dim] contiguous
        positions: torch.Tensor,  # [N] int64, each < P
    ) -> None:
        """Rotate-half RoPE in place on the first `num_heads` heads of each row of x."""
        self._rope(
            x.data_ptr(), x.stride(0), num_heads, head_dim, cos_sin.data_ptr(),
            positions.data_ptr(), x.shape[0],
        )  # fmt: skip

    def speculator_stage(
        self,
        projected: torch.Tensor,  # [G, d], any row stride
        token_ids: torch.Tensor,  # [G, c] int64 contiguous, each < vocab
        emb: torch.Tensor,  # [vocab, d] contiguous
        emb_scale: float,
        ln_weight: torch.Tensor,  # [d]
        ln_bias: torch.Tensor,  # [d]
        eps: float,
    ) -> torch.Tensor:  # [G * c, d]
        """One MLP-speculator stage for groups of siblings (`MLPSpeculator._draft_stage`):
        GELU(ln_weight * rms_norm(projected[g] + emb_scale * emb[token]) + ln_bias) per token,
        with erf's GELU within 3e-7."""
        token_ids = token_ids.to(torch.int64).contiguous()
        groups, c = token_ids.shape
        d = emb.shape[1]
        out = torch.empty(groups * c, d, dtype=torch.float32)
        self._speculator_stage(
            projected.data_ptr(), projected.stride(0), token_ids.data_ptr(), groups, c,
            emb.data_ptr(), emb_scale, ln_weight.data_ptr(), ln_bias.data_ptr(), eps,
            out.data_ptr(), d,
        )  # fmt: skip
        return out

    def log_softmax_topk(
        self, logits: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [N, k] float32, [N, k] int64
        """logits [N, V] contiguous -> the k largest log-probabilities of each row, in
        descending order (ties: the lower column first), and their columns."""
        logits = logits.contiguous()
        n, v = logits.shape
        top = torch.empty(n, k, dtype=torch.float32)
        ids = torch.empty(n, k, dtype=torch.int64)
        self._log_softmax_topk(logits.data_ptr(), n, v, k, top.data_ptr(), ids.data_ptr())
        return top, ids


def _cpu_signature() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keys = ("model name", "flags")
    lines = [ln for ln in info.splitlines() if ln.split(":")[0].strip() in keys]
    return "\n".join(sorted(set(lines)))


def _compile(
    compiler: str, target: Path, source: Path = SOURCE, extra_flags: Sequence[str] = ()
) -> None:
    """Build `source` into the library `target`, atomically (a concurrent process may do the
    same)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [compiler, *CFLAGS, *extra_flags, "-o", tmp, str(source), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load_library(source: Path, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The C file `source` compiled with `CFLAGS` + `extra_flags` for this CPU, building it on
    first use (cached per process, and on disk under `$SPECSERVE_HOME/kernels`).

    Raises RuntimeError where no C compiler works or the platform is not Linux/macOS (or the
    build fails), OSError if the library cannot be loaded, subprocess.TimeoutExpired if the
    build hangs.
    """
    compiler = shutil.which(os.environ.get("CC") or "cc")
    if compiler is None or os.name != "posix":
        raise RuntimeError("no C compiler found")
    flags = " ".join((*CFLAGS, *extra_flags))
    key = hashlib.sha256(
        source.read_bytes() + flags.encode() + _cpu_signature().encode()
    ).hexdigest()[:16]
    target = specserve_home() / "kernels" / f"{source.stem}-{key}.so"
    if not target.exists():
        try:
            _compile(compiler, target, source, extra_flags)
        except OSError:  # read-only home: build in a private temp folder instead
            target = Path(tempfile.mkdtemp(prefix="specserve-kernels-")) / target.name
            _compile(compiler, target, source, extra_flags)
    return ctypes.CDLL(str(target))


@functools.cache
def load_cpu_kernels() -> CpuKernels | None:
    """The compiled kernels for this CPU, building them on first use; None (with a warning)
    where no C compiler works or the platform is not Linux/macOS."""
    try:
        return CpuKernels(load_library(SOURCE))
    except RuntimeError as e:
        if "no C compiler" in str(e):
            logger.warning("no C compiler found: CPU glue and attention run as ATen ops (slower)")
        else:
            logger.warning("CPU kernels unavailable, using ATen ops: %s", e)
        return None
    except (OSError, subprocess.TimeoutExpired) as e:
        logger.warning("CPU kernels unavailable, using ATen ops: %s", e)
        return None


class RowsGemm:
    """`rows_gemm.c`: y [M, out] = x [M, in] @ W^T (+ bias) in float32 for few rows, on a
    process-wide pool of threads (the caller plus ``threads - 1`` workers).

    ``pack`` copies a layer's W^T into the panel layout the kernel streams; ``matmul`` runs on
    such a copy. ``matmul_inplace`` reads W^T itself, 16-column panels at its row stride, where
    the output features are a multiple of 16 (no copy, but slower: each step of a panel is a
    row of W^T away from the last). ``pack_q8`` / ``matmul_q8`` are the same on int8 weights
    with a float32 scale per output feature (a quarter of the weight bytes to stream; for
    products that may be approximate, such as a speculator's vocabulary heads). ``isa`` names
    the compiled path: "avx512", "avx2" or "scalar". Calls from several Python threads are
    serialised inside the library.
    """

    PANEL = 16  # columns per packed panel

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        for name, argtypes, restype in [
            ("rows_gemm", [_P, _I, _P, _P, _P, _I, _I, _I], ctypes.c_int),
            ("rows_gemm_inplace", [_P, _I, _P, _I, _P, _P, _I, _I, _I], ctypes.c_int),
            ("rows_gemm_pack", [_P, _I, _I, _I, _P], None),
            ("rows_gemm_q8", [_P, _I, _P, _P, _P, _P, _I, _I, _I], ctypes.c_int),
            ("rows_gemm_pack_q8", [_P, _I, _I, _I, _P, _P], None),
            ("rows_gemm_packed_size", [_I, _I], _I),
            ("rows_gemm_set_threads", [ctypes.c_int], None),
            ("rows_gemm_get_threads", [], ctypes.c_int),
            ("rows_gemm_set_spin_us", [_I], None),
            ("rows_gemm_set_chunk_bytes", [_I], None),
            ("rows_gemm_set_group_rows", [ctypes.c_int], None),
            ("rows_gemm_get_group_rows", [], ctypes.c_int),
            ("rows_gemm_isa", [], ctypes.c_char_p),
        ]:
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = restype
        self._run = lib.rows_gemm
        self._run_inplace = lib.rows_gemm_inplace
        self._run_q8 = lib.rows_gemm_q8
        self.isa: str = lib.rows_gemm_isa().decode()

    @property
    def threads(self) -> int:
        """Threads per call, the caller included."""
        return int(self.lib.rows_gemm_get_threads())

    def set_threads(self, n: int) -> None:
        """Threads per call, the caller included (clamped to 1..256); workers start lazily."""
        self.lib.rows_gemm_set_threads(n)

    def set_spin_us(self, us: int) -> None:
        """How long an idle worker spins for the next call before it sleeps."""
        self.lib.rows_gemm_set_spin_us(us)

    def set_chunk_bytes(self, nbytes: int) -> None:
        """Weight bytes per unit of work that the threads claim."""
        self.lib.rows_gemm_set_chunk_bytes(nbytes)

    @property
    def group_rows(self) -> int:
        """Rows per pass over the weights."""
        return int(self.lib.rows_gemm_get_group_rows())

    def set_group_rows(self, rows: int) -> None:
        """Rows per pass over the weights (clamped to 1..the path's tile limit); more rows are
        served in equal groups, the later ones reading the weights from cache."""
        self.lib.rows_gemm_set_group_rows(rows)

    def pack(self, wt: torch.Tensor) -> torch.Tensor:
        """W^T [in, out] float32 (last dim contiguous) -> packed copy, [ceil(out/16), in, 16]
        contiguous, the last panel zero-padded."""
        k, n = wt.shape
        panels = -(-n // self.PANEL)
        packed = torch.empty((panels, k, self.PANEL), dtype=torch.float32)  # [P, in, 16]
        self.lib.rows_gemm_pack(wt.data_ptr(), wt.stride(0), k, n, packed.data_ptr())
        return packed

    def pack_q8(self, wt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """W^T [in, out] float32 (last dim contiguous) -> (packed int8 [ceil(out/16), in, 16]
        contiguous, the last panel zero-padded; scales float32 [ceil(out/16) * 16], padding 0).
        Symmetric per output feature j: scales[j] = max |W^T[:, j]| / 127 (0 for a column of
        zeros), packed = W^T / scales[j] rounded to nearest (ties to even), in [-127, 127]."""
        k, n = wt.shape
        panels = -(-n // self.PANEL)
        packed = torch.empty((panels, k, self.PANEL), dtype=torch.int8)  # [P, in, 16]
        scales = torch.empty(panels * self.PANEL, dtype=torch.float32)  # [P * 16]
        self.lib.rows_gemm_pack_q8(
            wt.data_ptr(), wt.stride(0), k, n, packed.data_ptr(), scales.data_ptr()
        )
        return packed, scales

    def pad_bias(self, bias: torch.Tensor) -> torch.Tensor:
        """bias [out] -> [ceil(out/16) * 16], zero-padded, as ``matmul`` reads it."""
        n = bias.shape[0]
        out = torch.zeros(-(-n // self.PANEL) * self.PANEL, dtype=torch.float32)
        out[:n] = bias
        return out

    def matmul(
        self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [M, in] float32 (M >= 1) @ W^T -> y [M, n] float32, W packed by ``pack`` (n = out
        features); plus ``bias`` from ``pad_bias`` when given."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        m, k = x.shape
        y = torch.empty((m, n), dtype=torch.float32)  # [M, out]
        rc = self._run(
            x.data_ptr(), x.stride(0), packed.data_ptr(),
            None if bias is None else bias.data_ptr(), y.data_ptr(), m, k, n,
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("rows_gemm: no memory for a copy of x")
        return y

    def matmul_q8(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        scales: torch.Tensor,
        n: int,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [M, in] float32 (M >= 1) @ (packed * scales)^T -> y [M, n] float32, ``packed``
        and ``scales`` from ``pack_q8`` (n = out features); plus ``bias`` from ``pad_bias``
        when given. Sums in float32 in the order of ``matmul``."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        m, k = x.shape
        y = torch.empty((m, n), dtype=torch.float32)  # [M, out]
        rc = self._run_q8(
            x.data_ptr(), x.stride(0), packed.data_ptr(), scales.data_ptr(),
            None if bias is None else bias.data_ptr(), y.data_ptr(), m, k, n,
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("rows_gemm: no memory for a copy of x")
        return y

    def matmul_inplace(
        self, x: torch.Tensor, wt: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [M, in] float32 (M >= 1) @ wt -> y [M, out] float32, reading W^T ``wt`` [in, out]
        (last dim contiguous, out a multiple of 16) in place; plus ``bias`` [out] when given.
        ValueError if out is not a multiple of 16."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        m, k = x.shape
        n = wt.shape[1]
        y = torch.empty((m, n), dtype=torch.float32)  # [M, out]
        rc = self._run_inplace(
            x.data_ptr(), x.stride(0), wt.data_ptr(), wt.stride(0),
            None if bias is None else bias.data_ptr(), y.data_ptr(), m, k, n,
        )  # fmt: skip
        if rc == -2:
            raise ValueError(f"rows_gemm_inplace: out features {n} not a multiple of 16")
        if rc != 0:
            raise MemoryError("rows_gemm: no memory for a copy of x")
        return y


@functools.cache
def load_rows_gemm(
    variant: Literal["native", "avx2", "scalar"] = "native",
) -> RowsGemm | None:
    """`rows_gemm.c` built for this CPU ("native": AVX-512 or AVX2 as the CPU has them),
    without AVX-512 ("avx2", on a CPU that has AVX2) or as portable C ("scalar"); None (logged)
    where it cannot be built or loaded."""
    try:
        return RowsGemm(load_library(ROWS_SOURCE, ROWS_VARIANTS[variant]))
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
        logger.warning("rows_gemm (%s) unavailable: %s", variant, e)
        return None
