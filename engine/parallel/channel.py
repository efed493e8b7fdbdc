"""Rank 0's step messages to the other ranks of a tensor-parallel group.

A message is any picklable object (the runner sends the step's `SequenceInput`s). `send`
pickles it into a fixed-size byte buffer, first 8 bytes its length, and broadcasts the buffer
once; a message longer than the buffer (a long prompt's tokens, prompt-tuning embeddings)
costs a second broadcast of the rest. The group is a CPU (gloo) group that waits for messages
without a time limit, so idle ranks may wait for the next step for ever.
"""

from __future__ import annotations

import pickle
import struct
from typing import Any

import torch
import torch.distributed as dist

CAPACITY = 1 << 16
"""Bytes of the buffer broadcast for every message."""

_HEADER = struct.Struct("<q")


class StepChannel:
    """Rank 0 `send`s, every other rank `receive`s, in the same order."""

    def __init__(self, group: Any, capacity: int = CAPACITY) -> None:
        """`group`: a gloo process group of every rank (rank 0 is the sender)."""
        self.group = group
        self.data = bytearray(capacity)
        self.buffer = torch.frombuffer(self.data, dtype=torch.uint8)  # [capacity], shares data

    def send(self, message: object) -> None:
        """Broadcast `message` to every other rank (rank 0 only)."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        view = memoryview(self.data)
        head = len(view) - _HEADER.size
        _HEADER.pack_into(view, 0, len(data))
        view[_HEADER.size : _HEADER.size + min(head, len(data))] = memoryview(data)[:head]
        dist.broadcast(self.buffer, src=0, group=self.group)
        if len(data) > head:
            rest = torch.frombuffer(bytearray(data[head:]), dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.group)

    def receive(self) -> Any:
        """The next message rank 0 sends (blocks until it comes)."""
        dist.broadcast(self.buffer, src=0, group=self.group)
        view = memoryview(self.data)
        (size,) = _HEADER.unpack_from(view, 0)
        head = len(view) - _HEADER.size
        data = view[_HEADER.size : _HEADER.size + min(head, size)].tobytes()
        if size > head:
            rest = torch.empty(size - head, dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.group)
            data += bytes(rest.numpy())
        return pickle.loads(data)
