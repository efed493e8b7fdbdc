"""Errors the server maps to gRPC status codes beyond validation (see
`grpc_server.handle_errors`), and the response size bound that raises one."""

from __future__ import annotations

import math
from typing import Any


class GenerationError(Exception):
    """The engine failed a request (UNKNOWN, ``Request failed during generation: ...``)."""


class Overloaded(Exception):
    """More inputs in flight than MAX_CONCURRENT_REQUESTS allows (RESOURCE_EXHAUSTED)."""


class ResponseTooLarge(Exception):
    """A response message would exceed `max_response_bytes` (RESOURCE_EXHAUSTED)."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"the response would exceed {limit} bytes (MAX_RESPONSE_BYTES): request fewer token "
            "details (top_n_tokens, input_tokens), fewer or shorter inputs, or no offsets"
        )


class TokenizerFailure(Exception):
    """The tokenizer failed on a Tokenize input (UNKNOWN, the tokenizer's text, as TGIS)."""


class SizeBound:
    """Running size of a message being assembled from parts; raises ResponseTooLarge past
    `limit`. Each part counts its serialized size plus its field tag and length prefix."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0

    def add(self, part: Any) -> None:
        n = int(part.ByteSize())
        self.size += n + 1 + max(1, math.ceil(n.bit_length() / 7))
        if self.size > self.limit:
            raise ResponseTooLarge(self.limit)

    def check(self, message: Any) -> Any:
        """`message` itself, if it is at most `limit` bytes."""
        if message.ByteSize() > self.limit:
            raise ResponseTooLarge(self.limit)
        return message
