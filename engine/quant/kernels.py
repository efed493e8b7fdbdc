"""The one place that chooses the kernel a quantized layer runs.

On CPU every quantized layer runs with int8 activations, quantized per row (W8A8, and W4A8 for
4-bit GPTQ); on CUDA GPTQ is weight-only (activations in the model dtype) and `int8` is W8A8.
The kernel returned computes `engine.quant.reference.reference_linear` for that choice, to
float32 rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.quant.reference import reference_linear
from engine.quant.weights import QuantizedWeight

QuantKernel = Callable[[torch.Tensor], torch.Tensor]


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
    the activations quantized per row where `int8_activations` says so. CPU: the rows family's
    grouped integer kernels (`engine.kernels.quant_rows`, float32 rows in and out); CUDA: the
    Triton kernels (`engine.kernels.quant_triton`, whose `warm_up` compiles them); elsewhere,
    and for a weight-only product on a CPU, the reference product."""
    int8 = int8_activations(device, method)  # looked up at each build: see int8_activations
    if device.type == "cpu" and int8:
        from engine.kernels.quant_rows import build_quant_kernel

        rows = build_quant_kernel(weight, bias)
        if dtype == torch.float32:
            return rows
        return lambda x: rows(x.to(torch.float32).contiguous()).to(dtype)
    if device.type == "cuda":
        from engine.kernels.quant_triton import build_quant_kernel_cuda

        return build_quant_kernel_cuda(weight, bias, int8_activations=int8, dtype=dtype)

    def kernel(x: torch.Tensor) -> torch.Tensor:
        return reference_linear(x, weight, bias, int8_activations=int8).to(dtype)

    return kernel
