"""RMSNorm, optionally fused with the residual add before it."""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.buffers import OutputBuffer
from engine.kernels.cpu import CpuKernels


class RMSNorm(nn.Module):
    """RMSNorm, optionally fused with the residual add before it (vLLM's convention)."""

    def __init__(
        self,
        size: int,
        eps: float,
        dtype: torch.dtype,
        device: torch.device,
        kernels: CpuKernels | None = None,
        output: OutputBuffer | None = None,
    ) -> None:
        """With `kernels`, the normalised rows ``forward`` returns may be `output`'s memory,
        which its next `take` overwrites."""
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device=device), False)
        self.eps = eps
        self._eps = torch.tensor(eps, device=device)  # fp32, for addcmul
        self.kernels = kernels
        self.output = output

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, size] -> (norm(x + residual), x + residual); without a residual,
        (norm(x), x). The returned residual may be `residual` updated in place."""
        kernels = self.kernels
        if kernels is not None:
            out = None if self.output is None else self.output.take(*x.shape)
            if residual is None:
                return kernels.rms_norm(x, self.weight, self.eps, out), x
            return kernels.add_rms_norm_(x, residual, self.weight, self.eps, out), residual
        if residual is not None:
            x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # x * rsqrt(mean(x^2) + eps) * w in fewer ATen ops than F.rms_norm on CPU: the mean
            # square is |x|^2 / size, one fused reduction plus one addcmul.
            norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
            inv_rms = torch.addcmul(self._eps, norm, norm, value=1 / x.shape[-1]).rsqrt_()
            return (x * inv_rms).mul_(self.weight)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)
