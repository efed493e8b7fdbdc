"""`Job`: one engine request seen from the event loop (its output queue, tracker, timing)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

from engine.outputs import EngineOutput
from server.convert import OutputChunk
from server.engine_worker import EngineWorker, RequestTiming
from server.output_tracker import OutputTracker


def deliver(
    loop: asyncio.AbstractEventLoop,
    q: asyncio.Queue[EngineOutput | BaseException],
    item: EngineOutput | BaseException,
) -> None:
    with contextlib.suppress(RuntimeError):  # a closed loop: the server is gone
        loop.call_soon_threadsafe(q.put_nowait, item)


class Job:
    """One engine request seen from the event loop: its output queue, tracker and timing
    (`arrival` is when the RPC arrived)."""

    def __init__(self, worker: EngineWorker, tracker: OutputTracker, arrival: float) -> None:
        self.request_id = uuid.uuid4().hex
        self.timing = RequestTiming(arrival)
        self.queue: asyncio.Queue[EngineOutput | BaseException] = asyncio.Queue()
        self.tracker = tracker
        self._worker = worker
        self._done = False

    async def chunks(self) -> AsyncIterator[OutputChunk]:
        """The request's chunks up to the finished one; raises GenerationError on failure."""
        while not self.tracker.finished:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                self._done = True
                raise item
            if item.finished:
                self._done = True
            for chunk in self.tracker.add(item):
                yield chunk

    async def chunk_batches(self) -> AsyncIterator[list[OutputChunk]]:
        """The chunks of `chunks`, grouped: each group holds what the engine had delivered by
        the time it was taken, so a consumer that falls behind catches up in fewer, larger
        writes."""
        while not self.tracker.finished:
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            batch: list[OutputChunk] = []
            for item in items:
                if isinstance(item, BaseException):
                    self._done = True
                    raise item
                if item.finished:
                    self._done = True
                batch.extend(self.tracker.add(item))
                if self.tracker.finished:
                    break
            yield batch

    async def collect(self) -> list[OutputChunk]:
        return [chunk async for chunk in self.chunks()]

    def cancel(self) -> None:
        """Abort the engine request unless the engine already finished it."""
        if not self._done:
            self._done = True
            self._worker.abort(self.request_id)
