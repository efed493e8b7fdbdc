"""ctypes bindings of the fused float32 CPU kernels: the decoder's glue (`cpu_kernels.c`),
attention over the paged KV cache (`attention.c`) and the MLP speculator's drafting
(`drafting.c`), one library (whose sampler passes `engine.kernels.selection` binds); the build
of every C kernel (`load_library`; `engine.kernels.rows` binds `rows_gemm.c` with it); and the
CPU's feature flags (`cpu_flags`), which say whether bfloat16 products run in hardware
(`native_bf16`).

Each library is compiled on first use with the system C compiler (`$CC`, else `cc`) for this
CPU (`-march=native`) into `$SPECSERVE_HOME/kernels/`, keyed by its sources and headers, the
flags and the CPU, so that a later process loads it without compiling (`load_library`). Without
a compiler `load_cpu_kernels` returns None and the model runs the same maths as ATen ops
(`engine/models/llama.py`, `TorchAttentionBackend`).

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
from typing import Any

import torch

from engine.paths import specserve_home

logger = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name(name) for name in ("cpu_kernels.c", "attention.c", "drafting.c")
)
"""The C files of the CPU kernels' library (the glue, attention, drafting; all include
cpu_math.h)."""
CFLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fPIC", "-shared")

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float
# name -> (argument types, result type)
_SIGNATURES: dict[str, tuple[list[Any], Any]] = {
    "rms_norm": ([_P, _I, _P, _P, _I, _I, _F], None),
    "add_rms_norm": ([_P, _I, _P, _P, _P, _I, _I, _F], None),
    "silu_and_mul": ([_P, _P, _I, _I], None),
    "gather_columns": ([_P, _I, _I, _I, _P, _I, _P], ctypes.c_int),
    "rope": ([_P, _I, _I, _I, _P, _P, _I], None),
    "store_and_attend": (
        [_P, _I, _P, _P, _I, _P, _P, _P, _P, _I, _I, _P, _P, _P, _P, _P] + [_I] * 4 + [_F, _I],
        None,
    ),
    "speculator_stage": ([_P, _I, _P, _I, _I, _P, _F, _P, _P, _F, _P, _I], None),
    "log_softmax_topk": ([_P, _I, _I, _I, _P, _P, _P], None),
    "speculator_draft": (
        [_P, _I, _P, _I, _I, _I, _I, _P, _P, _I, _I, _P, _F, _F, _I, _I] + [_P] * 4,
        ctypes.c_int,
    ),
}


def bind(lib: ctypes.CDLL, signatures: dict[str, tuple[list[Any], Any]]) -> None:
    """Give each named function of `lib` its ctypes argument and result types."""
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype


class CpuKernels:
    """The loaded library's functions, with tensor-level wrappers."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        bind(lib, _SIGNATURES)
        self._rms_norm = lib.rms_norm
        self._add_rms_norm = lib.add_rms_norm
        self._silu_and_mul = lib.silu_and_mul
        self._rope = lib.rope
        self._gather_columns = lib.gather_columns
        self.store_and_attend = lib.store_and_attend  # called by CpuAttentionBackend
        self._speculator_stage = lib.speculator_stage
        self._log_softmax_topk = lib.log_softmax_topk
        self.speculator_draft = lib.speculator_draft  # called by FusedNodeDrafting

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [N, d] (any row stride) -> x * rsqrt(mean(x^2) + eps) * weight, [N, d]: `out`
        ([N, d] contiguous, not overlapping x) when given, else a new tensor."""
        n, d = x.shape
        out = torch.empty(n, d, dtype=torch.float32) if out is None else out
        self._rms_norm(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), n, d, eps)
        return out

    def add_rms_norm_(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """residual += x in place (residual [N, d] contiguous, x any row stride); returns
        rms_norm(residual) [N, d]: `out` ([N, d] contiguous, not overlapping residual) when
        given, else a new tensor."""
        n, d = residual.shape
        out = torch.empty(n, d, dtype=torch.float32) if out is None else out
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

    def gather_columns(self, wt: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """wt [k, ncols] (any row stride), ids [N] int64 -> wt[:, ids]^T, [N, k]: a tied
        embedding's rows from its head's transposed storage. IndexError for an id outside
        [0, ncols)."""
        (k, ncols), n = wt.shape, ids.shape[0]
        out = torch.empty(n, k, dtype=torch.float32)
        ids = ids.contiguous()
        args = (wt.data_ptr(), wt.stride(0), k, ncols, ids.data_ptr(), n, out.data_ptr())
        if self._gather_columns(*args) != 0:
            raise IndexError(f"gather_columns: an id is outside [0, {ncols})")
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
        self,
        logits: torch.Tensor,  # [N, V]
        k: int,
        columns: torch.Tensor | None = None,  # [V] int64 contiguous
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [N, k] float32, [N, k] int64
        """The k largest log-probabilities of each row of `logits`, in descending order (ties:
        the lower column first), and their columns, or `columns[column]` when given (a draft
        vocabulary's token ids)."""
        logits = logits.contiguous()
        n, v = logits.shape
        if columns is not None and (columns.dtype != torch.int64 or columns.shape != (v,)):
            raise ValueError(
                f"columns must be [{v}] int64, got {columns.dtype} {list(columns.shape)}"
            )
        top = torch.empty(n, k, dtype=torch.float32)
        ids = torch.empty(n, k, dtype=torch.int64)
        self._log_softmax_topk(
            logits.data_ptr(), n, v, k, 0 if columns is None else columns.contiguous().data_ptr(),
            top.data_ptr(), ids.data_ptr(),
        )  # fmt: skip
        return top, ids


def cpu_signature() -> str:
    """This CPU's model name and feature flags (what a build or a kernel plan is keyed by)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keys = ("model name", "flags")
    lines = [ln for ln in info.splitlines() if ln.split(":")[0].strip() in keys]
    return "\n".join(sorted(set(lines)))


BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""/proc/cpuinfo flags of bfloat16 dot-product instructions (AVX512_BF16, AMX-BF16): without
either, a bfloat16 matrix product is converted and computed element by element."""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo names them (empty where it cannot be read)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in info.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (`BF16_FLAGS`)."""
    return any(flag in cpu_flags() for flag in BF16_FLAGS)


def check_cpu_bf16() -> bool:
    """For a bfloat16 model on CPU: log at start-up which path its matrix products take; a
    warning where the CPU lacks `BF16_FLAGS`. Returns `native_bf16()`."""
    if native_bf16():
        found = [f for f in BF16_FLAGS if f in cpu_flags()]
        logger.info(
            "bfloat16 on CPU: matrix products on oneDNN (%s); norms, RoPE and attention as ATen "
            "ops (the fused C kernels are float32 only)",
            ", ".join(found),
        )
        return True
    logger.warning(
        "bfloat16 on a CPU without AVX512_BF16 or AMX-BF16: matrix products convert every "
        "element and run up to hundreds of times slower than float32; serve DTYPE_STR=float32 "
        "on this CPU"
    )
    return False


def _compile(
    compiler: str, target: Path, sources: Sequence[Path], extra_flags: Sequence[str] = ()
) -> None:
    """Build `sources` into the library `target`, atomically (a concurrent process may do the
    same)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [compiler, *CFLAGS, *extra_flags, "-o", tmp, *map(str, sources), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load_library(
    sources: Path | tuple[Path, ...], extra_flags: tuple[str, ...] = ()
) -> ctypes.CDLL:
    """The C file(s) `sources` compiled into one library with `CFLAGS` + `extra_flags` for this
    CPU, building it on first use (cached per process, and on disk under
    `$SPECSERVE_HOME/kernels` keyed by the sources, the headers beside them, the flags and the
    CPU).

    Raises RuntimeError where no C compiler works or the platform is not Linux/macOS (or the
    build fails), OSError if the library cannot be loaded, subprocess.TimeoutExpired if the
    build hangs.
    """
    compiler = shutil.which(os.environ.get("CC") or "cc")
    if compiler is None or os.name != "posix":
        raise RuntimeError("no C compiler found")
    files = (sources,) if isinstance(sources, Path) else sources
    headers = sorted({h for s in files for h in s.parent.glob("*.h")})
    flags = " ".join((*CFLAGS, *extra_flags))
    digest = hashlib.sha256(flags.encode() + cpu_signature().encode())
    for path in (*files, *headers):
        digest.update(path.read_bytes())
    target = specserve_home() / "kernels" / f"{files[0].stem}-{digest.hexdigest()[:16]}.so"
    if not target.exists():
        try:
            _compile(compiler, target, files, extra_flags)
        except OSError:  # read-only home: build in a private temp folder instead
            target = Path(tempfile.mkdtemp(prefix="specserve-kernels-")) / target.name
            _compile(compiler, target, files, extra_flags)
    return ctypes.CDLL(str(target))


@functools.cache
def load_cpu_kernels() -> CpuKernels | None:
    """The compiled kernels for this CPU, building them on first use; None (with a warning)
    where no C compiler works or the platform is not Linux/macOS."""
    try:
        return CpuKernels(load_library(SOURCES))
    except RuntimeError as e:
        if "no C compiler" in str(e):
            logger.warning("no C compiler found: CPU glue and attention run as ATen ops (slower)")
        else:
            logger.warning("CPU kernels unavailable, using ATen ops: %s", e)
        return None
    except (OSError, subprocess.TimeoutExpired) as e:
        logger.warning("CPU kernels unavailable, using ATen ops: %s", e)
        return None
