"""The one place that chooses the kernel a quantized layer runs.

On CPU every quantized layer runs with int8 activations, quantized per row and activation group
(`engine.quant.reference.quantize_rows`: W8A8, and W4A8 for 4-bit GPTQ); on CUDA GPTQ is
weight-only (activations in the model dtype) and `int8` is W8A8. The kernel returned computes
`engine.quant.reference.reference_linear` for that choice, to float32 rounding, and holds the
layer's only resident copy of the weight, in its own layout.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.quant.reference import reference_linear
from engine.quant.weights import QuantizedWeight


class QuantKernel(Protocol):
    """A built product: x [M, in] -> y [M, out], over the one copy of the weight it keeps."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def unpack(self) -> QuantizedWeight:
        """The weight in its logical form, rebuilt from the kernel's copy where that has another
        layout (for checks and tests: the caller's copy is not kept)."""
        ...

    @property
    def nbytes(self) -> int:
        """Resident bytes of the kernel's copy of the weight (the bias apart)."""
        ...


def int8_activations(device: torch.device, method: str) -> bool:
    """Whether a layer of quantization `method` ("gptq", "int8") quantizes its input rows: the
    one place that rule lives (tests replace it to check the weight-only product on CPU)."""
    return device.type == "cpu" or method == "int8"


def quant_kernel(
    weight: QuantizedWeight,
    bias: torch.Tensor | None,
    device: torch.device,
    dtype: torch.dtype,
    method: str,
) -> QuantKernel:
    """x [M, in] (any M, `dtype` on `device`) -> y [M, out] in `dtype`: x @ W.T + bias, with
    the activations quantized per row and group where `int8_activations` says so. CPU: the rows
    family's grouped integer kernels (`engine.kernels.quant_rows`, float32 rows in and out);
    CUDA: the Triton kernels (`engine.kernels.quant_triton`, whose `warm_up` compiles them);
    elsewhere, and for a weight-only product on a CPU, the reference product. The caller drops
    `weight`: the kernel keeps what it needs."""
    int8 = int8_activations(device, method)  # looked up at each build: see int8_activations
    if device.type == "cpu" and int8:
        from engine.kernels.quant_rows import build_quant_kernel

        rows = build_quant_kernel(weight, bias)
        return rows if dtype == torch.float32 else _Float32Rows(rows, dtype)
    if device.type == "cuda":
        from engine.kernels.quant_triton import build_quant_kernel_cuda

        return build_quant_kernel_cuda(weight, bias, int8_activations=int8, dtype=dtype)
    return _Reference(weight, bias, int8, dtype)


class _Float32Rows:
    """A float32 kernel serving another dtype: rows converted in and out."""

    def __init__(self, inner: QuantKernel, dtype: torch.dtype) -> None:
        self.inner, self.dtype = inner, dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.to(torch.float32).contiguous()).to(self.dtype)

    def unpack(self) -> QuantizedWeight:
        return self.inner.unpack()

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes


class _Reference:
    """`reference_linear` over the weight as it is (slow: tests, and devices without a
    kernel)."""

    def __init__(
        self, weight: QuantizedWeight, bias: torch.Tensor | None, int8: bool, dtype: torch.dtype
    ) -> None:
        self.weight, self.bias, self.int8, self.dtype = weight, bias, int8, dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return reference_linear(x, self.weight, self.bias, int8_activations=self.int8).to(
            self.dtype
        )

    def unpack(self) -> QuantizedWeight:
        return self.weight

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes
