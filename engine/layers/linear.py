"""Linear layer whose storage layout and matrix kernel are private.

On CPU the weight is stored transposed, ``W^T`` as ``[in, out]`` contiguous, the layout the "rows"
kernel packs its panels from and a tied embedding gathers its rows from (columns of W^T, read in
place); ``F.linear`` (MKL) reads it as a transposed ``[out, in]`` view. On CUDA the weight is stored
``[out, in]`` and ``forward`` is plain ``F.linear``.

The layer holds one kernel per M bucket (`engine.kernels.matmul` builds them,
`engine.kernels.plan_store.choose_kernels` chooses them and calls ``install``); ``forward`` costs
one tuple lookup plus the kernel.

Inference only: inputs must not require grad. A layer is not safe for concurrent ``forward`` calls
from several threads (its kernels may write to one shared output buffer). The placement and
dtype are fixed at construction: the weights are plain tensor attributes, so ``Module.to`` leaves
them alone.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engine.kernels.buffers import OutputBuffer
from engine.kernels.matmul import GatedKernel, KernelFn, default_plan, torch_kernel
from engine.kernels.pages import huge_page_zeros


class Linear(torch.nn.Module):
    """y = x @ W^T + b. W is [out_features, in_features] logically (HF layout); the storage
    layout and the kernel are private.

    Until a plan is installed (``install``), CPU fp32 layers use the "rows" kernel for M = 1 to
    64 and ``F.linear`` above (`engine.kernels.matmul.default_plan`); CPU bf16 layers use oneDNN
    on a prepacked copy of W where the CPU has bfloat16 instructions; other dtypes and devices
    use ``F.linear``.
    Weights must be written through ``load_rows`` / ``load_bias`` (which bump
    ``weights_version``), or before the first ``forward``: kernels that hold a re-laid-out copy
    make it again only when the version changes.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        gated: bool = False,
        output: OutputBuffer | None = None,
    ) -> None:
        """`gated`: the output features are a gated activation's gate, then its up projection,
        of out_features / 2 each (`silu_and_mul`). `output`: what ``forward`` and
        ``silu_and_mul`` return may be `output`'s memory, which its next `take` overwrites (a
        decoder layer's results, used up before the next layer makes them)."""
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.gated = gated
        self.output = output
        self.dtype = dtype
        self.device = torch.device(device)
        # CPU: W^T [in, out] contiguous. Elsewhere: W [out, in] contiguous.
        self.transposed = self.device.type == "cpu"
        shape = (in_features, out_features) if self.transposed else (out_features, in_features)
        self.storage = (
            huge_page_zeros(shape, dtype)
            if self.transposed
            else torch.zeros(shape, dtype=dtype, device=self.device)
        )
        self.bias: torch.Tensor | None = (
            torch.zeros(out_features, dtype=dtype, device=self.device) if bias else None
        )
        self.weights_version = 0  # bumped by load_rows / load_bias: kernels holding copies repack
        self.kernel_names: dict[int, str] = {}  # M bucket -> kernel name, for reports
        self._by_m: tuple[KernelFn, ...] = ()  # index M -> kernel, for M < len(_by_m)
        self._large: KernelFn = torch_kernel(self)  # for M >= len(_by_m)
        self.install(default_plan(self))

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
        self.weights_version += 1

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
        self.weights_version += 1

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

    def read_ahead(self) -> None:
        """Nothing: `QuantLinear.read_ahead`'s counterpart. A float layer's weights are four
        times an int8 layer's, and reading the first of them ahead did not make its product
        faster."""

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """For a gated layer, x [M, in_features] -> silu(gate) * up [M, out_features / 2],
        fused into the product by the kernel serving M rows; None where that kernel does not
        fuse it (the caller applies its own to `forward`)."""
        m = x.shape[0]
        kernel = self._by_m[m] if m < len(self._by_m) else self._large
        return kernel.silu_and_mul(x) if isinstance(kernel, GatedKernel) else None

    def install(self, plan: Mapping[int, tuple[str, KernelFn]]) -> None:
        """Install kernels: ``plan[bucket] = (name, fn)`` serves every M up to ``bucket`` that no
        smaller bucket serves; M above the largest bucket uses the largest bucket's kernel.
        M = 0 always goes to ``F.linear``.
        """
        buckets = sorted(plan)
        by_m = [torch_kernel(self)]  # M = 0
        by_m += [plan[next(b for b in buckets if b >= m)][1] for m in range(1, buckets[-1] + 1)]
        self._by_m = tuple(by_m)
        self._large = plan[buckets[-1]][1]
        self.kernel_names = {b: plan[b][0] for b in buckets}
