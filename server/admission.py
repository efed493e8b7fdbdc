"""`Admission`: the MAX_CONCURRENT_REQUESTS bound, one permit per engine request, shared by the
gRPC and the HTTP APIs (they run on one event loop, so a plain counter is enough)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from server.errors import Overloaded

OVERLOADED_MSG = "Model is overloaded"


class Admission:
    """At most `max_concurrent_requests` permits held at once; not thread-safe (event loop
    only)."""

    def __init__(self, max_concurrent_requests: int) -> None:
        self.max_concurrent_requests = max_concurrent_requests
        self.in_flight = 0

    @contextmanager
    def admit(self, n: int) -> Iterator[None]:
        """Hold `n` permits for the block; Overloaded ("Model is overloaded") when they would
        exceed the bound."""
        if self.in_flight + n > self.max_concurrent_requests:
            raise Overloaded(OVERLOADED_MSG)
        self.in_flight += n
        try:
            yield
        finally:
            self.in_flight -= n
