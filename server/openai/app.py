"""The HTTP application on PORT (Starlette, served by `server.http_server`): `GET /health`,
`GET /metrics` (as before: `/health` 200 with an empty body when the model answers, else 503
``{"error":"unhealthy"}``; anything unknown 404) and, with an `ApiContext`, the OpenAI-compatible
`GET /v1/models`, `POST /v1/completions` and `POST /v1/chat/completions`.

A request body must be JSON (``Content-Type: application/json``, else 415) of at most
`max_body_bytes` (else 413); its model must be the served one (else 404). A client that goes
away before its unary response is ready cancels the request, as one gone mid-stream does."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pydantic
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from server.metrics import ServerMetrics
from server.openai import chat, completions
from server.openai.context import ApiContext
from server.openai.errors import ApiError, from_pydantic
from server.openai.protocol import ChatCompletionRequest, CompletionRequest

_UNHEALTHY = b'{"error":"unhealthy"}'
Body = TypeVar("Body", CompletionRequest, ChatCompletionRequest)


DRAIN_FACTOR = 16
"""A body beyond the limit is still read (and dropped) up to this many times the limit, so
that its client reads the 413 instead of a reset connection; a larger one is cut off."""


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, refused with 415 unless JSON and 413 beyond `max_bytes`."""
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise ApiError(415, "the body must be JSON (Content-Type: application/json)", err=None)
    declared = request.headers.get("content-length")
    too_large = ApiError(413, f"the body is larger than {max_bytes} bytes", err=None)
    if declared is not None and declared.isdigit() and int(declared) > DRAIN_FACTOR * max_bytes:
        raise too_large
    body = bytearray()
    size = 0
    async for part in request.stream():
        size += len(part)
        if size > DRAIN_FACTOR * max_bytes:
            raise too_large
        if size <= max_bytes:
            body += part
    if size > max_bytes:
        raise too_large
    return bytes(body)


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """`work`'s response; cancelled (and a bare 499) when the client goes away first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, ApiError):
            await task
        return Response(status_code=499)
    return task.result()


def build_app(
    health: Callable[[], bool],
    metrics: ServerMetrics,
    api: ApiContext | None = None,
    max_body_bytes: int = 4 * 1024 * 1024,
) -> Starlette:
    """The application; `health` may block (it runs on a worker thread)."""

    async def get_health(request: Request) -> Response:
        if await run_in_threadpool(health):
            return Response(b"", 200, media_type="text/plain")
        return Response(_UNHEALTHY, 503, media_type="application/json")

    async def get_metrics(request: Request) -> Response:
        return Response(await run_in_threadpool(metrics.render), media_type=CONTENT_TYPE_LATEST)

    routes = [Route("/health", get_health), Route("/metrics", get_metrics)]
    if api is not None:
        routes += _api_routes(api, metrics, max_body_bytes)
    return Starlette(routes=routes)


def _api_routes(api: ApiContext, metrics: ServerMetrics, max_body_bytes: int) -> list[Route]:
    async def models(request: Request) -> Response:
        model = {
            "id": api.model_id,
            "object": "model",
            "created": api.created,
            "owned_by": "specserve",
            "max_model_len": api.limits.max_sequence_length,
        }
        return JSONResponse({"object": "list", "data": [model]})

    def endpoint(
        route: str,
        schema: type[Body],
        create: Callable[[ApiContext, Body, list[tuple[str, str]]], Awaitable[Response]],
    ) -> Route:
        async def handle(request: Request) -> Response:
            try:
                body = await read_body(request, max_body_bytes)
                try:
                    req = schema.model_validate_json(body)
                except pydantic.ValidationError as e:
                    raise from_pydantic(e) from None
                if not api.serves(req.model):
                    raise ApiError(
                        404,
                        f"The model '{req.model[:256]}' does not exist; this server serves "
                        f"'{api.model_id}'",
                        param="model",
                        code="model_not_found",
                        err=None,
                    )
                headers = list(request.headers.items())
                response = await _unless_disconnected(request, create(api, req, headers))
            except ApiError as e:
                response = e.response()
            except ClientDisconnect:
                response = Response(status_code=499)
            metrics.http_request_count.labels(route, str(response.status_code)).inc()
            return response

        return Route(route, handle, methods=["POST"])

    return [
        Route("/v1/models", models),
        endpoint(completions.ROUTE, CompletionRequest, completions.create),
        endpoint(chat.ROUTE, ChatCompletionRequest, chat.create),
    ]
