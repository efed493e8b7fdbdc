"""Client-side helpers of the OpenAI-API server tests: the official `openai` client for a
`ServerProcess`, raw HTTP posts (for bodies the client will not send) and the gRPC request
the same as an HTTP one."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import openai

from tools.server_process import ServerProcess


def client(server: ServerProcess, timeout: float = 120.0) -> openai.OpenAI:
    """The official client on `server`'s HTTP port, without retries (a 429 must show)."""
    return openai.OpenAI(
        base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=timeout
    )


def async_client(server: ServerProcess, timeout: float = 300.0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=timeout
    )


def post(
    server: ServerProcess,
    path: str,
    body: bytes | dict[str, Any],
    content_type: str = "application/json",
) -> tuple[int, dict[str, Any]]:
    """POST `body` (a dict is JSON-encoded, NaN allowed) to `path`: status and JSON reply."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        f"{server.http_url}{path}", data=data, headers={"Content-Type": content_type}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return int(reply.status), json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return int(e.code), json.loads(e.read())
