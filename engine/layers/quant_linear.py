"""A linear layer over a `QuantizedWeight`: y = x @ W^T + b with W stored as integers.

It stands in for `engine.layers.linear.Linear` in the decoder layers (same `forward`, `bias`,
`silu_and_mul`, `in_features`, `out_features`), and runs the kernel
`engine.quant.kernels.quant_kernel` chooses. The weights arrive through the checkpoint loader's
sinks as a `QuantizedWeight`, which `build_kernel` (or the first `forward` after the weights
changed) hands to the kernel: from then on the kernel's copy, in its own layout, is the only one
(`unpack_weight` rebuilds the logical form for checks).

- "int8": `load_rows` takes float rows (any dtype) and keeps only their int8 values and one
  scale per row (max |row| / 127, round half to even: `engine.quant.reference.quantize_rows`),
  so no float copy of the weight stays resident.
- "gptq": `gptq_sink(row_offset, field)` receives a part's `qweight`, `qzeros`, `scales` and
  `g_idx` (the part starting at output row `row_offset` of a fused layer); once every part has
  all four, they are assembled (`engine.quant.gptq`) into one `QuantizedWeight`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.quant.gptq import GptqPart, assemble, read_part
from engine.quant.kernels import QuantKernel, quant_kernel
from engine.quant.reference import quantize_rows
from engine.quant.scheme import QuantScheme
from engine.quant.weights import QuantizedWeight

GPTQ_FIELDS = ("qweight", "qzeros", "scales", "g_idx")


class QuantLinear(nn.Module):
    """y = x @ W^T + b, W [out_features, in_features] quantized by `scheme`; `bias` stays in
    `dtype`. Inference only; not safe for concurrent `forward` calls from several threads."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        scheme: QuantScheme,
        dtype: torch.dtype,
        device: torch.device | str,
        gated: bool = False,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.scheme, self.dtype, self.device = scheme, dtype, torch.device(device)
        self.gated = gated
        self.bias: torch.Tensor | None = (
            torch.zeros(out_features, dtype=dtype, device=self.device) if bias else None
        )
        self._weight: QuantizedWeight | None = None  # loaded, not handed to a kernel yet
        self._raw: dict[int, dict[str, torch.Tensor]] = {}  # gptq: part row -> field -> tensor
        self._parts: dict[int, GptqPart | None] = {}  # gptq: part row -> its unpacked form
        self._kernel: QuantKernel | None = None
        self._read_ahead: Callable[[], None] = _nothing  # the built kernel's `read_ahead`

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, {self.scheme.describe()}"
        )

    # -- loading --------------------------------------------------------------------------

    def load_rows(self, row_offset: int, weight: torch.Tensor) -> None:
        """int8: quantize float rows [rows, in] into rows [row_offset, row_offset + rows) of W.
        ValueError naming the shapes when they do not fit."""
        if self.scheme.method != "int8":
            raise ValueError("load_rows: a GPTQ layer takes qweight, qzeros, scales and g_idx")
        rows = weight.shape[0] if weight.dim() == 2 else -1
        if weight.dim() != 2 or weight.shape[1] != self.in_features or row_offset < 0:
            raise ValueError(
                f"load_rows: expected a [rows, {self.in_features}] weight, got shape "
                f"{list(weight.shape)} at row_offset {row_offset}"
            )
        if row_offset + rows > self.out_features:
            raise ValueError(
                f"load_rows: rows [{row_offset}, {row_offset + rows}) exceed {self.out_features}"
            )
        into = self._loading_int8()
        with torch.no_grad():
            for start in range(0, rows, 1024):  # bounds the float32 temporaries
                chunk = weight[start : start + 1024].to(torch.float32)
                q, s = quantize_rows(chunk, self.in_features)
                at = row_offset + start
                into.qweight[at : at + chunk.shape[0]].copy_(q)
                into.scales[at : at + chunk.shape[0]].copy_(s)

    def _loading_int8(self) -> QuantizedWeight:
        """int8: the weight rows are written into (the kernel's, unpacked, once it is built)."""
        if self._weight is None:
            if self._kernel is not None:
                self._weight = self._kernel.unpack()
            else:
                n, k, device = self.out_features, self.in_features, self.device
                self._weight = QuantizedWeight(
                    bits=8,
                    group_size=k,
                    qweight=torch.zeros(n, k, dtype=torch.int8, device=device),
                    scales=torch.zeros(n, 1, dtype=torch.float32, device=device),
                    zeros=None,
                    perm=None,
                )
            self._kernel, self._read_ahead = None, _nothing
        return self._weight

    def expect_part(self, row_offset: int) -> None:
        """gptq: a part of the fused layer starts at output row `row_offset`."""
        self._parts[row_offset] = None

    def gptq_sink(self, row_offset: int, field: str) -> GptqSink:
        """Where the loader writes `field` (one of GPTQ_FIELDS) of the part at `row_offset`."""
        return GptqSink(self, row_offset, field)

    def _receive(self, row_offset: int, field: str, tensor: torch.Tensor) -> None:
        raw = self._raw.setdefault(row_offset, {})
        raw[field] = tensor.clone() if field == "scales" else tensor
        if len(raw) < len(GPTQ_FIELDS):
            return
        del self._raw[row_offset]
        s = self.scheme
        self._parts[row_offset] = read_part(
            raw["qweight"], raw["qzeros"], raw["scales"], raw["g_idx"],
            bits=s.bits, zeros_minus_one=s.zeros_minus_one,
        )  # fmt: skip
        if all(p is not None for p in self._parts.values()):
            parts = [p for _, p in sorted(self._parts.items()) if p is not None]
            self._weight = _to_device(assemble(parts, s.bits), self.device)
            self._parts = {row: None for row in self._parts}  # drop the unpacked copies
            self._kernel, self._read_ahead = None, _nothing

    # -- running --------------------------------------------------------------------------

    def build_kernel(self) -> QuantKernel:
        """The layer's kernel, built from the loaded weight if the weights changed since; the
        layer then drops its `QuantizedWeight` (the kernel keeps its own copy). RuntimeError
        when no weight has been loaded."""
        kernel = self._kernel
        if kernel is None:
            if self._weight is None:
                raise RuntimeError("QuantLinear: the weights have not been loaded")
            kernel = self._kernel = quant_kernel(
                self._weight, self.bias, self.device, self.dtype, self.scheme.method
            )
            self._read_ahead = getattr(kernel, "read_ahead", _nothing)
            self._weight = None
        return kernel

    def unpack_weight(self) -> QuantizedWeight:
        """The layer's weight in its logical form, rebuilt from the kernel's copy (builds the
        kernel; for checks and tests: nothing keeps what it returns)."""
        return self.build_kernel().unpack()

    def weight_bytes(self) -> int:
        """Resident bytes of the weight, as the kernel keeps it (builds the kernel), and the
        bias."""
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.build_kernel().nbytes + bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in_features] -> [M, out_features] in the layer's dtype."""
        kernel = self._kernel
        if kernel is None:
            kernel = self.build_kernel()
        return kernel(x)

    def read_ahead(self) -> None:
        """Have the kernel's weights read into cache ahead of the next `forward`, by a thread
        that would otherwise wait (the CPU kernels; nothing elsewhere, or before the kernel is
        built)."""
        self._read_ahead()

    def warm_up(self, max_rows: int) -> None:
        """Compile every variant the layer's kernel launches for up to `max_rows` rows (a
        Triton kernel's `warm_up`; nothing for kernels that do not compile), so that no step
        compiles while serving. Nothing for a layer without weights."""
        if self._weight is None and self._kernel is None:
            return
        warm = getattr(self.build_kernel(), "warm_up", None)
        if warm is not None:
            warm(max_rows)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """No fused gate: the caller applies its own SiLU-and-mul to `forward`."""
        return None


def _nothing() -> None:
    pass


def _to_device(weight: QuantizedWeight, device: torch.device) -> QuantizedWeight:
    """`weight` with its tensors on `device`."""
    if device.type == "cpu":
        return weight
    return QuantizedWeight(
        bits=weight.bits,
        group_size=weight.group_size,
        qweight=weight.qweight.to(device),
        scales=weight.scales.to(device),
        zeros=None if weight.zeros is None else weight.zeros.to(device),
        perm=None if weight.perm is None else weight.perm.to(device),
    )


class GptqSink:
    """One field of one part of a GPTQ `QuantLinear`, as a loader destination."""

    def __init__(self, layer: QuantLinear, row_offset: int, field: str) -> None:
        self.layer, self.row_offset, self.field = layer, row_offset, field
        layer.expect_part(row_offset)

    def load_rows(self, row_offset: int, tensor: torch.Tensor) -> None:
        """Hand the tensor read (`row_offset` is unused: the sink knows its part)."""
        self.layer._receive(self.row_offset, self.field, tensor)
