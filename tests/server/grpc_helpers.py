"""Client-side helpers shared by the server tests that talk gRPC to one real server process:
start it (`running_server`), build requests from plain dicts (`batch_request`,
`single_request`), read texts back (`generate_texts`, `stream_text`) and capture a failure's
status (`status_of`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import json_format

from engine.paths import model_path
from server.pb import generation_pb2 as pb
from server.pb import generation_pb2_grpc
from tests.reference import require_model
from tools.server_process import ServerProcess, ServerStartError


@dataclass
class Server:
    process: ServerProcess
    channel: grpc.Channel
    stub: generation_pb2_grpc.GenerationServiceStub


@contextlib.contextmanager
def running_server(model: str, env: Mapping[str, str], log: Path) -> Iterator[Server]:
    """A started server on `model` with `env`, its output in `log`, and a channel to it; the
    test fails (not errors) when the model is not prepared or the server does not start."""
    require_model(model_path(model))
    process = ServerProcess(model, env, log)
    try:
        process.start()
    except ServerStartError as e:
        pytest.fail(str(e))
    channel = grpc.insecure_channel(process.grpc_target)
    try:
        yield Server(process, channel, generation_pb2_grpc.GenerationServiceStub(channel))
    finally:
        channel.close()
        process.stop(stop_timeout_s=20)


def batch_request(texts: list[str], params: dict[str, Any], **fields: Any) -> Any:
    body = {"requests": [{"text": t} for t in texts], "params": params, **fields}
    return json_format.ParseDict(body, pb.BatchedGenerationRequest())


def single_request(text: str, params: dict[str, Any]) -> Any:
    body = {"request": {"text": text}, "params": params}
    return json_format.ParseDict(body, pb.SingleGenerationRequest())


def generate_texts(server: Server, texts: list[str], params: dict[str, Any]) -> list[str]:
    response = server.stub.Generate(batch_request(texts, params), timeout=60)
    return [r.text for r in response.responses]


def stream_text(server: Server, text: str, params: dict[str, Any]) -> str:
    request = single_request(text, params)
    return "".join(m.text for m in server.stub.GenerateStream(request, timeout=60))


def status_of(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), str(info.value.details())
