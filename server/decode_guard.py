"""`RequestDecodeGuard`: request bytes that do not decode get INVALID_ARGUMENT, not a
traceback per message and UNKNOWN."""

from __future__ import annotations

import inspect
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from server.messages import clip

logger = logging.getLogger(__name__)

DECODE_WARNING_INTERVAL_S = 10.0


class _Undecodable:
    """What the guarded deserializer returns for bytes that are not a valid request message."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


class _RateLimitedWarning:
    """Logs a WARNING at most once per `interval_s`, counting the occurrences it held back."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last = -math.inf
        self._held_back = 0

    def warn(self, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self._held_back += 1
            return
        if self._held_back:
            message += f" ({self._held_back} more in the previous {self.interval_s:.0f} s)"
        logger.warning(message, *args)
        self._last, self._held_back = now, 0


class RequestDecodeGuard(grpc.aio.ServerInterceptor):
    """Answers request bytes that do not decode (malformed protobuf, invalid UTF-8 in a string)
    with INVALID_ARGUMENT ``malformed request message: ...`` and at most one WARNING line per
    `interval_s`. Left alone, grpc.aio raises in its deserializer, logs a traceback per message
    and answers UNKNOWN. Applies to unary-request methods (streamed requests pass through)."""

    def __init__(self, interval_s: float = DECODE_WARNING_INTERVAL_S) -> None:
        self._warning = _RateLimitedWarning(interval_s)
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method = str(handler_call_details.method)
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(method, handler)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        deserialize = handler.request_deserializer

        def guarded(data: bytes) -> Any:
            try:
                return deserialize(data)
            except Exception as e:
                return _Undecodable(f"{type(e).__name__}: {e}")

        async def reject(request: _Undecodable, context: grpc.aio.ServicerContext) -> None:
            self._warning.warn("undecodable request to %s: %s", method, clip(request.error))
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"malformed request message: {clip(request.error)}",
            )

        serialize = handler.response_serializer
        if not handler.response_streaming:
            inner = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Undecodable):
                    await reject(request, context)
                result = inner(request, context)
                return await result if inspect.isawaitable(result) else result

            return grpc.unary_unary_rpc_method_handler(unary, guarded, serialize)
        inner_stream = handler.unary_stream
        if inspect.iscoroutinefunction(inner_stream):  # the reader/writer API

            async def writer(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Undecodable):
                    await reject(request, context)
                return await inner_stream(request, context)

            return grpc.unary_stream_rpc_method_handler(writer, guarded, serialize)
        if inspect.isasyncgenfunction(inner_stream):

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                if isinstance(request, _Undecodable):
                    await reject(request, context)
                async for item in inner_stream(request, context):
                    yield item

            return grpc.unary_stream_rpc_method_handler(stream, guarded, serialize)
        return handler  # a synchronous generator: left to grpc
