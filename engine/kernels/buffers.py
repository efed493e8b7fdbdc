"""Output memory that a CPU step's small products and norms share from layer to layer.

A decode or verify step makes a few small float32 results per decoder layer. Rather than a new
tensor each (an allocation, in a block that the other pool thread has often just used), each
role (the norms' output, the QKV product's, ...) has one buffer that every layer writes in turn:
a result is used up within its layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MAX_ROWS = 64
"""Results of up to this many rows (decode and verify steps) use the buffer; larger ones (prompt
chunks) are new tensors."""


class OutputBuffer:
    """Memory for one role's float32 CPU results, reused from call to call: `take` hands out the
    same memory every time (grown when a call needs more rows), so what one call returns is
    valid only until the next `take`. Not for concurrent calls."""

    def __init__(self, max_rows: int = MAX_ROWS) -> None:
        self.max_rows = max_rows
        self._tensor: torch.Tensor | None = None
        self._views: dict[tuple[int, ...], torch.Tensor] = {}  # shape -> view of _tensor

    def take(self, *shape: int) -> torch.Tensor:
        """An uninitialised contiguous tensor of `shape` (rows first): a view of the buffer for
        up to `max_rows` rows, else a new tensor."""
        view = self._views.get(shape)
        if view is not None:
            return view
        rows = shape[0]
        if rows > self.max_rows:
            return torch.empty(shape, dtype=torch.float32)
        buffer = self._tensor
        if buffer is None or buffer.shape[0] < rows or buffer.shape[1:] != shape[1:]:
            buffer = self._tensor = torch.empty(shape, dtype=torch.float32)
            self._views.clear()
        view = self._views[shape] = buffer[:rows]
        return view


@dataclass(frozen=True)
class DecoderBuffers:
    """The buffers a model's decoder layers share, one per result of a layer (its attention's
    output is the attention backend's own): each result is used up within its layer, before the
    next layer writes the same role."""

    norm: OutputBuffer = field(default_factory=OutputBuffer)  # both norms' outputs
    qkv: OutputBuffer = field(default_factory=OutputBuffer)
    o: OutputBuffer = field(default_factory=OutputBuffer)
    gate_up: OutputBuffer = field(default_factory=OutputBuffer)  # or silu(gate) * up, fused
    down: OutputBuffer = field(default_factory=OutputBuffer)
