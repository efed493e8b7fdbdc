"""Kernel selection for linear layers (`engine.layers.linear.Linear`) by measurement.

``select_kernels`` times every candidate kernel of `engine.kernels.matmul.KERNELS` per distinct
layer shape and per M bucket, rejects any kernel whose result is not fp32-exact against a float64
reference, and installs the fastest per bucket in each layer. ``KernelTable`` reports what it
measured and chose.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from engine.kernels import matmul
from engine.kernels.matmul import KernelFn, MatmulLayer

DEFAULT_M_VALUES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)


class TunableLayer(MatmulLayer, Protocol):
    """What selection reads and calls of a layer (`engine.layers.linear.Linear` provides it)."""

    def install(self, plan: Mapping[int, tuple[str, KernelFn]]) -> None:
        """Serve each M bucket of `plan` with its (name, kernel)."""
        ...


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
    passes: dict[int, dict[str, float]] = field(default_factory=dict)
    """M -> {variant: ms of one pass over all layers}: "per shape" (the per-shape choices) and
    "all NAME" (kernel NAME on every layer), what decided the plan (see ``select_kernels``)."""
    rows_prefetch: dict[int, dict[str, float]] = field(default_factory=dict)
    """M -> the "rows" kernel's prefetch modes tried -> the median, over the faster half of the
    rounds, of a pass over all layers in that mode as a multiple of the round's fastest mode (see
    ``select_kernels``); empty if not tried."""
    shared: dict[Any, Any] = field(default_factory=dict, repr=False)
    source: str = "timed"
    """"timed" by ``select_kernels``, or "stored": a stored plan installed without timing
    (`engine.kernels.plan_store`), when ``timings`` and ``passes`` are empty."""
    plan_path: str = ""
    """Where the plan is stored ("" if it is not)."""

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
        for m, times in self.passes.items():
            best = min(times, key=lambda v: times[v])
            text = ", ".join(f"{v} {t:.3f}{'*' if v == best else ''}" for v, t in times.items())
            lines.append(f"one pass, M {m}, ms: {text}")
        for m, times in self.rows_prefetch.items():
            best = min(times, key=lambda v: times[v])
            text = ", ".join(f"{v} {t:.3f}{'*' if v == best else ''}" for v, t in times.items())
            lines.append(f"rows kernel prefetch, one pass, M {m}, x the round's fastest: {text}")
        return "\n".join(lines)


def _rel_err(layer: TunableLayer, x: torch.Tensor, y: torch.Tensor) -> float:
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
    layers: list[TunableLayer],
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


def _time_passes(
    passes: dict[str, list[tuple[KernelFn, torch.Tensor]]], rounds: int
) -> dict[str, float]:
    """Best milliseconds of each pass (kernels applied in order, each to its input), the passes
    run in turn ``rounds`` times after one warm-up each."""
    best = dict.fromkeys(passes, float("inf"))
    for r in range(rounds + 1):
        for name, calls in passes.items():
            t0 = time.perf_counter()
            for fn, x in calls:
                fn(x)
            if r:
                best[name] = min(best[name], (time.perf_counter() - t0) * 1e3)
    return best


def faster_rounds_medians(times: dict[str, list[float]]) -> dict[str, float]:
    """Variant -> its times over rounds (every list as long, the variants of a round timed back to
    back) -> variant -> the median, over the faster half of the rounds (those whose fastest
    variant took least; the middle round too where there is an odd number), of its time over
    its round's fastest variant's."""
    fastest = [min(round_times) for round_times in zip(*times.values(), strict=True)]
    faster_half = sorted(range(len(fastest)), key=lambda r: fastest[r])[: (len(fastest) + 1) // 2]
    return {v: statistics.median(t[r] / fastest[r] for r in faster_half) for v, t in times.items()}


def _tune_rows_prefetch(
    rows_fns: list[KernelFn], in_features: list[int], m_values: Sequence[int], rounds: int
) -> dict[int, dict[str, float]]:
    """Time one pass of the "rows" kernels `rows_fns` (a model's layers in order, with their
    in_features) at each M of `m_values` from 2 to the kernel's ``group_rows`` (one tile each;
    ``group_rows`` itself too where `m_values` goes beyond it) under each of `PREFETCH_MODES`, in
    turn `rounds` times after a warm-up. Tiles of each row count get the mode with the least
    median, over the faster half of the rounds, of its pass time over the round's fastest mode's
    at the timed M nearest it (by ratio, the smaller on a tie). Memory bandwidth on a shared host
    changes between rounds, by more than the modes differ, so each round's modes (timed back to
    back) are compared with one another, and a mode that is best in only some rounds is not the
    best. The faster rounds decide: while memory is slow every mode streams at its speed and the
    modes come out nearly even; fast memory shows how far the arithmetic of several rows holds
    the stream back, which is what prefetching changes.
    Returns M -> mode -> that median (empty, the settings untouched, when no M is in range)."""
    from engine.kernels.rows import PREFETCH_MODES, load_rows_gemm

    lib = load_rows_gemm()
    if lib is None:
        return {}
    top = lib.group_rows  # the most rows of one tile in a pass
    timed = {m for m in m_values if 2 <= m <= top}
    if top >= 2 and any(m > top for m in m_values):
        timed.add(top)
    ms = sorted(timed)
    if not ms:
        return {}
    gen = torch.Generator().manual_seed(0)
    inputs = {m: [torch.randn((m, k), generator=gen) for k in in_features] for m in ms}
    times: dict[int, dict[str, list[float]]] = {m: {v: [] for v in PREFETCH_MODES} for m in ms}
    for r in range(rounds + 1):
        for mode in PREFETCH_MODES:
            lib.set_prefetch(mode)
            for m in ms:
                t0 = time.perf_counter()
                for fn, x in zip(rows_fns, inputs[m], strict=True):
                    fn(x)
                if r:
                    times[m][mode].append((time.perf_counter() - t0) * 1e3)
    medians = {m: faster_rounds_medians(by) for m, by in times.items()}
    for rows in range(2, lib.max_rows + 1):
        nearest = min(ms, key=lambda m: (abs(math.log(m / rows)), m))
        lib.set_prefetch(min(medians[nearest], key=lambda v: medians[nearest][v]), rows)
    return medians


def select_kernels(
    linears: Iterable[TunableLayer],
    m_values: Sequence[int] = DEFAULT_M_VALUES,
    kernels: Sequence[str] | None = None,
    *,
    rounds: int = 3,
    target_s: float = 0.002,
    prune: float = 1.25,
    default_margin: float = 1.25,
    pass_rounds: int = 5,
    prefetch_rounds: int = 9,
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

    First, where the "rows" kernel can serve every layer, its prefetch mode per tile row count
    (process-wide) is chosen by timing passes over all the layers (``_tune_rows_prefetch``,
    ``prefetch_rounds`` rounds; 0: kept as it is): whether several rows stream faster with software
    prefetch, and of which kind, depends on the CPU and the row count.

    The kernel `engine.kernels.matmul.default_kernel` names for an M is kept unless the fastest
    exact one beats it by more than ``default_margin`` x.

    Last, per M, one pass over all the layers (in the order given, as a forward pass calls them)
    with the per-shape choices is timed against passes with one kernel on every layer (each
    kernel chosen for some shape at that M, and the default one, where exact on every shape), in
    turn ``pass_rounds`` times (0: skip), and the fastest is installed, the default kernel on
    every layer again unless the fastest beats it by more than ``default_margin`` x: a kernel's
    cost in a pass depends on its neighbours (a thread pool that another library's call let fall
    asleep, caches that a different layout left cold), which timing one shape at a time does not
    see, and in a model step on its neighbours there too (the ops between the products), which
    the passes do not see either.
    """
    t_start = time.perf_counter()
    table = KernelTable(threads=torch.get_num_threads())
    groups: dict[tuple[Any, ...], list[TunableLayer]] = {}
    linears_list = list(linears)
    # group -> (its layers, kernel name -> one kernel per layer, (kernel, M) -> exact, plan)
    built: dict[tuple[Any, ...], tuple[list[TunableLayer], dict[str, list[KernelFn]], Any, Any]]
    built = {}
    order: list[tuple[tuple[Any, ...], int]] = []  # (group, index in it) of each layer, in order
    for layer in linears_list:
        if layer.transposed:
            key = (layer.in_features, layer.out_features, layer.dtype, layer.bias is not None)
            order.append((key, len(groups.setdefault(key, []))))
            groups[key].append(layer)
    gen = torch.Generator().manual_seed(0)
    group_fns: dict[tuple[Any, ...], dict[str, list[KernelFn]]] = {}
    for group, layers in groups.items():
        registry = matmul.KERNELS  # looked up per call, so tests may substitute the registry
        names = [
            s.name for s in registry.values()
            if (kernels is None or s.name in kernels) and s.supports(layers[0])
        ]  # fmt: skip
        group_fns[group] = {
            name: [registry[name].build(ly, table.shared) for ly in layers] for name in names
        }
    if prefetch_rounds > 0 and order and all("rows" in fns for fns in group_fns.values()):
        table.rows_prefetch = _tune_rows_prefetch(
            [group_fns[key]["rows"][i] for key, i in order],
            [key[0] for key, _ in order],
            m_values,
            prefetch_rounds,
        )
    for group, layers in groups.items():
        k, n, dtype, _ = group
        fns = group_fns[group]
        plan: dict[int, str] = {}
        exact_at: dict[tuple[str, int], bool] = {}  # (kernel, M) -> exact on this group
        for m in sorted(set(m_values)):
            x = torch.randn((m, k), generator=gen).to(dtype)
            cells = _time_cell(layers, fns, x, rounds, target_s, prune)
            table.timings.extend(cells.values())
            exact = [c for c in cells.values() if c.exact]
            exact_at.update({(c.kernel, m): c.exact for c in cells.values()})
            best = min(exact, key=lambda c: c.ms) if exact else None
            default = cells.get(matmul.default_kernel(m))
            if best is not None and default is not None and default.exact:
                plan[m] = default.kernel if default.ms <= default_margin * best.ms else best.kernel
            else:
                plan[m] = best.kernel if best is not None else "torch"
            if plan[m] not in fns:  # nothing exact: fall back to F.linear
                fns["torch"] = [matmul.torch_kernel(ly) for ly in layers]
        table.chosen[(k, n)] = plan
        built[group] = (layers, fns, exact_at, plan)
    for m in sorted(set(m_values)) if pass_rounds > 0 and order else ():
        chosen = {b[3][m] for b in built.values()}
        uniform = [
            name
            for name in sorted(chosen | {matmul.default_kernel(m)})
            if all(
                name in fns and exact_at.get((name, m), False)
                for _, fns, exact_at, _ in built.values()
            )
        ]  # kernels that may serve every layer at this M
        if len(chosen) == 1 and len(uniform) <= 1:
            continue  # one kernel everywhere already, and no other to try
        variants = {f"all {name}": name for name in uniform}
        if len(chosen) > 1:
            variants["per shape"] = ""
        calls: dict[str, list[tuple[KernelFn, torch.Tensor]]] = {v: [] for v in variants}
        for key, i in order:
            _, fns, _, plan = built[key]
            x = torch.randn((m, key[0]), generator=gen).to(key[2])  # [M, in]
            for variant, name in variants.items():
                calls[variant].append((fns[name or plan[m]][i], x))
        times = _time_passes(calls, pass_rounds)
        table.passes[m] = times
        fastest = min(times, key=lambda v: times[v])
        uniform_default = f"all {matmul.default_kernel(m)}"
        if times.get(uniform_default, float("inf")) <= default_margin * times[fastest]:
            fastest = uniform_default
        if variants[fastest]:
            for _, _, _, plan in built.values():
                plan[m] = variants[fastest]
    for layers, fns, _, plan in built.values():
        for i, layer in enumerate(layers):
            layer.install({m: (name, fns[name][i]) for m, name in plan.items()})
    table.seconds = time.perf_counter() - t_start
    return table
