"""Rotary position embeddings (RoPE) as transformers computes them, with Llama-3 and linear
scaling, from a cos/sin table grown on demand."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class RopeConfig(Protocol):
    """What RoPE reads of a model's configuration (`engine.models.config.LlamaConfig` has it)."""

    @property
    def head_dim(self) -> int: ...
    @property
    def rope_theta(self) -> float: ...
    @property
    def rope_scaling(self) -> dict[str, Any] | None: ...
    @property
    def max_position_embeddings(self) -> int: ...


def rope_inv_freq(config: RopeConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, as transformers computes them."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


@dataclass(frozen=True)
class RopeStep:
    """One step's RoPE input, shared by every layer."""

    positions: torch.Tensor  # [N] int64
    cos_sin: torch.Tensor | None  # [2, N, 1, D] looked up; None when a kernel reads the table


class RotaryEmbedding:
    """Rotate-half RoPE from a cos/sin table grown on demand; looked up once per step."""

    def __init__(self, config: RopeConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.inv_freq = rope_inv_freq(config).to(device)
        self.dtype = dtype
        self.head_dim = config.head_dim
        self._cos_sin = torch.empty(0, 2, config.head_dim, dtype=dtype, device=device)
        self._grow(config.max_position_embeddings)

    def _grow(self, num_positions: int) -> None:
        positions = torch.arange(num_positions, device=self.inv_freq.device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq[None, :]  # [P, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        # [P, 2, D]: (cos, cos) and (-sin, sin), so that rotate(x) = x * cos + swap(x) * sin.
        self._cos_sin = torch.stack(
            (torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)), dim=1
        ).to(self.dtype)

    @property
    def table(self) -> torch.Tensor:
        """[P, 2, D]: row p is (cos, cos) and (-sin, sin) at position p."""
        return self._cos_sin

    def reserve(self, max_position: int) -> None:
        """Grow the table to hold `max_position`, so that steps up to it never grow it."""
        if max_position >= self._cos_sin.shape[0]:
            self._grow(max(2 * self._cos_sin.shape[0], max_position + 1))

    def prepare(self, positions: torch.Tensor, max_position: int, lookup: bool) -> RopeStep:
        """[N] positions (all <= max_position) -> the step's RoPE input; `lookup` gathers
        [2, N, 1, D] cos / signed sin rows for `rotate`."""
        self.reserve(max_position)
        if not lookup:
            return RopeStep(positions, None)
        return RopeStep(positions, self._cos_sin[positions].transpose(0, 1).unsqueeze(2))

    def rotate(self, x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """x [N, heads, D] -> x rotated by RoPE, as transformers' `apply_rotary_pos_emb`."""
        n, h, d = x.shape
        swapped = x.view(n, h, 2, d // 2).flip(2).view(n, h, d)  # (x2, x1)
        return x * cos_sin[0] + swapped * cos_sin[1]
