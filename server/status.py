"""`handle_errors`: how an RPC handler's exceptions become gRPC statuses and failure metrics."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, TypeVar

import grpc

from server.errors import GenerationError, Overloaded, ResponseTooLarge, TokenizerFailure
from server.messages import ValidationError, clip
from server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

MAX_ERROR_MESSAGE_BYTES = 1024
"""Any error message is clipped to this (a status message travels in gRPC metadata)."""


class _Servicer(Protocol):
    metrics: ServerMetrics


T = TypeVar("T")


def handle_errors(kind: str) -> Callable[[T], T]:
    """Map exceptions of an RPC handler (coroutine or async generator) to gRPC statuses:
    ValidationError -> INVALID_ARGUMENT with its exact message, Overloaded ->
    RESOURCE_EXHAUSTED "Model is overloaded", ResponseTooLarge -> RESOURCE_EXHAUSTED,
    GenerationError, TokenizerFailure and anything else -> UNKNOWN (only the last logged with a
    traceback). Messages are clipped to MAX_ERROR_MESSAGE_BYTES. Counts each Generate failure in
    `tgi_request_failure` (a response too large as err="validation"), cancellations as
    err="cancelled"; `kind` "tokenize" counts nothing."""
    counted = kind != "tokenize"

    def decorate(fn: Any) -> Any:
        async def fail(self: _Servicer, context: grpc.aio.ServicerContext, e: Exception) -> None:
            code, err, message = grpc.StatusCode.UNKNOWN, "unknown", str(e)
            if isinstance(e, ValidationError):
                code, err, message = grpc.StatusCode.INVALID_ARGUMENT, "validation", e.message
            elif isinstance(e, Overloaded):
                code, err, message = grpc.StatusCode.RESOURCE_EXHAUSTED, "conc_limit", str(e)
            elif isinstance(e, ResponseTooLarge):
                code, err = grpc.StatusCode.RESOURCE_EXHAUSTED, "validation"
            elif isinstance(e, GenerationError):
                err, message = "generate", f"Request failed during generation: {e}"
            elif not isinstance(e, TokenizerFailure):
                logger.exception("%s failed", fn.__name__)
            if counted:
                self.metrics.request_failure.labels(err).inc()
            await context.abort(code, clip(message, MAX_ERROR_MESSAGE_BYTES))

        if inspect.isasyncgenfunction(fn):

            @functools.wraps(fn)
            async def stream_wrapper(
                self: _Servicer, request: Any, context: grpc.aio.ServicerContext
            ) -> AsyncIterator[Any]:
                async with contextlib.aclosing(fn(self, request, context)) as stream:
                    try:
                        async for item in stream:
                            yield item
                    except grpc.aio.AbortError:
                        raise
                    except (asyncio.CancelledError, GeneratorExit):
                        # GeneratorExit: the client went away while the stream was suspended
                        # at a yield, and grpc closed it; aclosing() cancels the job now.
                        if counted:
                            self.metrics.request_failure.labels("cancelled").inc()
                        raise
                    except Exception as e:
                        await fail(self, context, e)

            return stream_wrapper

        @functools.wraps(fn)
        async def wrapper(self: _Servicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return await fn(self, request, context)
            except grpc.aio.AbortError:
                raise
            except asyncio.CancelledError:
                if counted:
                    self.metrics.request_failure.labels("cancelled").inc()
                raise
            except Exception as e:
                await fail(self, context, e)

        return wrapper

    return decorate
