"""ctypes binding of `rows_gemm.c`, a float32 matrix product for few rows (`RowsGemm`, served as
the "rows" linear kernel by `engine.kernels.matmul`, and on int8 weights as the speculator's
vocabulary heads), built with its tiles (`rows_tiles.h`) and thread pool (`unit_pool.c`) for
this CPU by `engine.kernels.cpu.load_library`. Without a C compiler `load_rows_gemm` returns
None and the "rows" kernel is not offered.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch

from engine.kernels.cpu import bind, load_library
from engine.kernels.pages import huge_page_zeros

logger = logging.getLogger(__name__)

ROWS_SOURCES = tuple(
    Path(__file__).with_name(name) for name in ("rows_gemm.c", "rows_quant.c", "unit_pool.c")
)
# Extra flags per `load_rows_gemm` variant: its instruction-set path is chosen at compile time.
ROWS_VARIANTS: dict[str, tuple[str, ...]] = {
    "native": ("-pthread",),
    "avx2": ("-pthread", "-mno-avx512f"),
    "scalar": ("-pthread", "-DSPECSERVE_SCALAR"),
}

PREFETCH_MODES: tuple[str, ...] = ("none", "nta", "l2")
"""How tiles of several rows may prefetch weights, in the order of rows_gemm.c's PREFETCH_*:
not at all (the hardware's prefetcher alone), 32 lines ahead into L1 as non-temporal, or 128
lines ahead into L2 over a tile's panels together. The fastest depends on the CPU and the row
count: chosen by timing."""

_P = ctypes.c_void_p
_I = ctypes.c_int64
# name -> (argument types, result type)
_SIGNATURES: dict[str, tuple[list[Any], Any]] = {
    "rows_gemm": ([_P, _I, _P, _P, _P, _I, _I, _I], None),
    "rows_gemm_inplace": ([_P, _I, _P, _I, _P, _P, _I, _I, _I], ctypes.c_int),
    "rows_gemm_pack": ([_P, _I, _I, _I, _P], None),
    "rows_gemm_pairs": ([_P, _I, _P, _P, _P, _I, _I, _I, _I], ctypes.c_int),
    "rows_gemm_pack_pairs": ([_P, _I, _I, _I, _P], ctypes.c_int),
    "rows_gemm_q8": ([_P, _I, _P, _P, _P, _P, _I, _I, _I], None),
    "rows_gemm_pack_q8": ([_P, _I, _I, _I, _P, _P], None),
    "rows_gemm_set_threads": ([ctypes.c_int], None),
    "rows_gemm_get_threads": ([], ctypes.c_int),
    "rows_gemm_set_spin_us": ([_I], None),
    "rows_gemm_set_chunk_bytes": ([_I], None),
    "rows_gemm_set_group_rows": ([ctypes.c_int], None),
    "rows_gemm_get_group_rows": ([], ctypes.c_int),
    "rows_gemm_set_prefetch": ([_I, _I], ctypes.c_int),
    "rows_gemm_get_prefetch": ([_I], _I),
    "rows_gemm_isa": ([], ctypes.c_char_p),
    "unit_pool_read_ahead": ([_P, _I], None),
    "rows_gemm_q8_isa": ([], ctypes.c_char_p),
    "rows_gemm_max_rows": ([], ctypes.c_int),
}


class RowsGemm:
    """`rows_gemm.c`: y [M, out] = x [M, in] @ W^T (+ bias) in float32 for few rows, on a
    process-wide pool of threads (the caller plus ``threads - 1`` workers).

    ``pack`` copies a layer's W^T into the panel layout the kernel streams; ``matmul`` runs on
    such a copy. ``matmul_inplace`` reads W^T itself, 16-column panels at its row stride, where
    the output features are a multiple of 16 (no copy, but slower: each step of a panel is a
    row of W^T away from the last). ``pack_q8`` / ``matmul_q8`` are int8 products: int8
    weights with a float32 scale per output feature (a quarter of the weight bytes to stream)
    times each row of x quantised to int8 with a scale of its own, the integer products summed
    exactly (`rows_q8.h`); for products that may be approximate, such as a speculator's
    vocabulary heads.
    ``pack_pairs`` / ``matmul_pairs`` serve a gated layer (its output features the gate, then
    the up projection, each a multiple of 16): panels packed in (gate, up) pairs, whose product
    is written in W^T's column order or, fused, as silu(gate) * up. ``isa`` names
    the compiled path: "avx512", "avx2" or "scalar"; ``q8_isa`` the int8 one: "avx512-vnni",
    "avx2" or "scalar". Calls from several Python threads are
    serialised inside the library.
    """

    PANEL = 16  # columns per packed panel

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        bind(lib, _SIGNATURES)
        self._run = lib.rows_gemm
        self._run_inplace = lib.rows_gemm_inplace
        self._run_q8 = lib.rows_gemm_q8
        self.isa: str = lib.rows_gemm_isa().decode()
        self.q8_isa: str = lib.rows_gemm_q8_isa().decode()
        # for C callers: drafting.c's speculator_draft, attention.c's store_and_attend
        self.q8_address: int = ctypes.cast(lib.rows_gemm_q8, ctypes.c_void_p).value or 0
        self.pool_run_address: int = ctypes.cast(lib.unit_pool_run, ctypes.c_void_p).value or 0

    @property
    def threads(self) -> int:
        """Threads per call, the caller included."""
        return int(self.lib.rows_gemm_get_threads())

    def set_threads(self, n: int) -> None:
        """Threads per call, the caller included (clamped to 1..256); workers start lazily."""
        self.lib.rows_gemm_set_threads(n)

    def read_ahead_of(self, memory: torch.Tensor) -> Callable[[], None]:
        """A call that has an idle worker of the pool read `memory` (a contiguous CPU tensor:
        the weights of a coming product) into cache while the caller does other work; a later
        request replaces it, the next product stops it; nothing with one thread. `memory` must
        outlive the call's uses."""
        nbytes = memory.numel() * memory.element_size()
        return functools.partial(self.lib.unit_pool_read_ahead, memory.data_ptr(), nbytes)

    def set_spin_us(self, us: int) -> None:
        """How long an idle worker spins for the next call before it sleeps (default 500)."""
        self.lib.rows_gemm_set_spin_us(us)

    def set_chunk_bytes(self, nbytes: int) -> None:
        """Weight bytes per claim of work by a thread at most (claims shrink as a call ends)."""
        self.lib.rows_gemm_set_chunk_bytes(nbytes)

    @property
    def group_rows(self) -> int:
        """Rows per pass over the weights."""
        return int(self.lib.rows_gemm_get_group_rows())

    def set_group_rows(self, rows: int) -> None:
        """Rows per pass over the weights (clamped to 1..the path's tile limit); more rows are
        served in groups (of equal size, or on AVX2 full groups and the rest), the later ones
        reading the weights from cache."""
        self.lib.rows_gemm_set_group_rows(rows)

    @property
    def max_rows(self) -> int:
        """The most rows one tile takes (a pass over the weights takes ``group_rows``)."""
        return int(self.lib.rows_gemm_max_rows())

    def prefetch(self, rows: int) -> str:
        """How tiles of ``rows`` rows prefetch weights: one of `PREFETCH_MODES` ("none" for
        one row). ValueError outside 1..``max_rows``."""
        mode = int(self.lib.rows_gemm_get_prefetch(rows))
        if mode < 0:
            raise ValueError(f"rows_gemm: no tile of {rows} rows")
        return PREFETCH_MODES[mode]

    def set_prefetch(self, mode: str, rows: int | None = None) -> None:
        """Set how tiles of ``rows`` rows (2..``max_rows``; None: all of them) prefetch
        weights, process-wide; results do not change. ValueError for another row count or a
        mode not in `PREFETCH_MODES`."""
        if mode not in PREFETCH_MODES:
            raise ValueError(f"rows_gemm: prefetch mode {mode!r} not in {PREFETCH_MODES}")
        for r in range(2, self.max_rows + 1) if rows is None else (rows,):
            if self.lib.rows_gemm_set_prefetch(r, PREFETCH_MODES.index(mode)) != 0:
                raise ValueError(f"rows_gemm: tiles of {r} rows do not prefetch")

    def pack(self, wt: torch.Tensor) -> torch.Tensor:
        """W^T [in, out] float32 (last dim contiguous) -> packed copy, [ceil(out/16), in, 16]
        contiguous, the last panel zero-padded."""
        k, n = wt.shape
        panels = -(-n // self.PANEL)
        packed = huge_page_zeros((panels, k, self.PANEL), torch.float32)  # [P, in, 16]
        self.lib.rows_gemm_pack(wt.data_ptr(), wt.stride(0), k, n, packed.data_ptr())
        return packed

    def pack_pairs(self, wt: torch.Tensor) -> torch.Tensor:
        """W^T [in, 2 * d] float32 of a gated layer (gate columns, then up; d a multiple of 16)
        -> [2 * d / 16, in, 16] contiguous: panel 2q from gate columns [16q, 16q + 16), panel
        2q + 1 from the up columns beside them. ValueError if d is not a multiple of 16."""
        k, n = wt.shape
        packed = huge_page_zeros((n // self.PANEL, k, self.PANEL), torch.float32)  # [P, in, 16]
        if self.lib.rows_gemm_pack_pairs(wt.data_ptr(), wt.stride(0), k, n, packed.data_ptr()):
            raise ValueError(f"rows_gemm_pack_pairs: out features {n} not a multiple of 32")
        return packed

    def pad_bias_pairs(self, bias: torch.Tensor) -> torch.Tensor:
        """A gated layer's bias [2 * d] in the order of ``pack_pairs``' panels."""
        return bias.view(2, -1, self.PANEL).transpose(0, 1).contiguous().view(-1)

    def matmul_pairs(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        n: int,
        bias: torch.Tensor | None = None,
        silu: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [M, in] float32 (M >= 1) @ W^T of a gated layer packed by ``pack_pairs`` (n = out
        features; ``bias`` from ``pad_bias_pairs``): y [M, n] as ``matmul`` on W^T, or with
        ``silu`` silu(gate) * up [M, n / 2], the same sums through `cpu_math.h`'s
        `silu_mul`; written to ``out`` (contiguous, of y's shape) when given."""
        if n % (2 * self.PANEL) != 0:
            raise ValueError(f"rows_gemm_pairs: out features {n} not a multiple of 32")
        run, cols = self.lib.rows_gemm_pairs, n // 2 if silu else n
        return self._product(run, x, (packed.data_ptr(),), n, bias, cols, (int(silu),), out)

    def pack_q8(self, wt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """W^T [in, out] float32 (last dim contiguous) -> (packed uint8 [ceil(out/16),
        ceil(in/4), 16, 4] contiguous: q + 128 by panels of 16 output features and groups of 4
        input features, padding q = 0; scales float32 [ceil(out/16) * 16], padding 0).
        Symmetric per output feature j: scales[j] = max |W^T[:, j]| / 127 (0 for a column of
        zeros), q = W^T / scales[j] rounded to nearest (ties to even), in [-127, 127]."""
        k, n = wt.shape
        panels, groups = -(-n // self.PANEL), -(-k // 4)
        packed = huge_page_zeros((panels, groups, self.PANEL, 4), torch.uint8)  # [P, G, 16, 4]
        scales = torch.empty(panels * self.PANEL, dtype=torch.float32)  # [P * 16]
        self.lib.rows_gemm_pack_q8(
            wt.data_ptr(), wt.stride(0), k, n, packed.data_ptr(), scales.data_ptr()
        )
        return packed, scales

    @staticmethod
    def unpack_q8(packed: torch.Tensor, k: int) -> torch.Tensor:
        """``pack_q8``'s panels [P, G, 16, 4] -> q int8 [P * 16, k] (output feature, input
        feature; padded features included)."""
        panels, groups = packed.shape[:2]
        q = packed.permute(0, 2, 1, 3).reshape(panels * 16, groups * 4)[:, :k]
        return (q.to(torch.int16) - 128).to(torch.int8)

    def pad_bias(self, bias: torch.Tensor) -> torch.Tensor:
        """bias [out] -> [ceil(out/16) * 16], zero-padded, as ``matmul`` reads it."""
        n = bias.shape[0]
        out = torch.zeros(-(-n // self.PANEL) * self.PANEL, dtype=torch.float32)
        out[:n] = bias
        return out

    def matmul(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        n: int,
        bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [M, in] float32 (M >= 1) @ W^T -> y [M, n] float32, W packed by ``pack`` (n = out
        features); plus ``bias`` from ``pad_bias`` when given; written to ``out`` ([M, n]
        contiguous) when given."""
        return self._product(self._run, x, (packed.data_ptr(),), n, bias, out=out)

    def matmul_q8(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        scales: torch.Tensor,
        n: int,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [M, in] float32 (M >= 1) -> y [M, n] float32 = (q_x * scale_x) @ (q * scales)^T,
        ``packed`` and ``scales`` from ``pack_q8`` (n = out features), each row of x quantised
        as ``pack_q8`` quantises a column of W^T (scale_x = max |row| / 127), the integer
        products summed exactly, then (sum * scale_x) * scales[j]; plus ``bias`` from
        ``pad_bias`` when given."""
        weights = (packed.data_ptr(), scales.data_ptr())
        return self._product(self._run_q8, x, weights, n, bias)

    def matmul_inplace(
        self, x: torch.Tensor, wt: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [M, in] float32 (M >= 1) @ wt -> y [M, out] float32, reading W^T ``wt`` [in, out]
        (last dim contiguous, out a multiple of 16) in place; plus ``bias`` [out] when given.
        ValueError if out is not a multiple of 16."""
        n = wt.shape[1]
        if n % self.PANEL != 0:
            raise ValueError(f"rows_gemm_inplace: out features {n} not a multiple of 16")
        return self._product(self._run_inplace, x, (wt.data_ptr(), wt.stride(0)), n, bias)

    @staticmethod
    def _product(
        run: Any,
        x: torch.Tensor,  # [M, in] float32
        weights: tuple[int, ...],  # the weight arguments of `run` after x's
        n: int,
        bias: torch.Tensor | None,
        cols: int | None = None,
        tail: tuple[int, ...] = (),
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [M, cols]
        """One call of a `rows_gemm*` product, whose arguments are x, its row stride, the
        weights, the bias or NULL, y ([M, cols], cols = n unless given: `out` when given, else
        a new tensor), then m, k, n and `tail`."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        m, k = x.shape
        shape = (m, n if cols is None else cols)
        y = torch.empty(shape, dtype=torch.float32) if out is None else out
        bias_ptr = None if bias is None else bias.data_ptr()
        run(x.data_ptr(), x.stride(0), *weights, bias_ptr, y.data_ptr(), m, k, n, *tail)
        return y


@functools.cache
def load_rows_gemm(
    variant: Literal["native", "avx2", "scalar"] = "native",
) -> RowsGemm | None:
    """`rows_gemm.c` built for this CPU ("native": AVX-512 or AVX2 as the CPU has them),
    without AVX-512 ("avx2", on a CPU that has AVX2) or as portable C ("scalar"); None (logged)
    where it cannot be built or loaded."""
    try:
        return RowsGemm(load_library(ROWS_SOURCES, ROWS_VARIANTS[variant]))
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
        logger.warning("rows_gemm (%s) unavailable: %s", variant, e)
        return None
