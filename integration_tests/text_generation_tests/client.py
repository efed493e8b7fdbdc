"""Runs test cases against a server over gRPC, all at once, as TGIS's integration tests do.

Every case's unary call and, for one-input generate cases, its GenerateStream twin start a few
milliseconds apart and run concurrently, so the server batches them together in ever-changing
combinations; the results must not depend on that.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import json_format

from server.pb import generation_pb2 as pb
from server.pb import generation_pb2_grpc
from text_generation_tests.cases import Case

CALL_TIMEOUT_S = 240.0


@dataclass
class Outcome:
    """What one call returned: `messages` (one dict for a unary call, every message of a
    stream) or a gRPC error `code` name and `details`."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    code: str | None = None
    details: str | None = None

    @property
    def response(self) -> dict[str, Any]:
        """The unary response; fails the test if the call failed."""
        assert self.code is None, f"call failed: {self.code}: {self.details}"
        return self.messages[0]


@dataclass
class CaseOutcome:
    unary: Outcome
    stream: Outcome | None


def _to_dict(message: Any) -> dict[str, Any]:
    return dict(json_format.MessageToDict(message))


async def _unary(stub: generation_pb2_grpc.GenerationServiceStub, case: Case) -> Outcome:
    try:
        if case.request_type == "tokenize":
            request = json_format.ParseDict(case.request, pb.BatchedTokenizeRequest())
            return Outcome([_to_dict(await stub.Tokenize(request, timeout=CALL_TIMEOUT_S))])
        if case.request_type == "generate_stream":
            single = json_format.ParseDict(case.request, pb.SingleGenerationRequest())
            call = stub.GenerateStream(single, timeout=CALL_TIMEOUT_S)
            return Outcome([_to_dict(m) async for m in call])
        batch = json_format.ParseDict(case.request, pb.BatchedGenerationRequest())
        return Outcome([_to_dict(await stub.Generate(batch, timeout=CALL_TIMEOUT_S))])
    except grpc.aio.AioRpcError as e:
        return Outcome(code=e.code().name, details=e.details())


async def _stream(stub: generation_pb2_grpc.GenerationServiceStub, case: Case) -> Outcome:
    request = json_format.ParseDict(case.stream_request(), pb.SingleGenerationRequest())
    try:
        call = stub.GenerateStream(request, timeout=CALL_TIMEOUT_S)
        return Outcome([_to_dict(m) async for m in call])
    except grpc.aio.AioRpcError as e:
        return Outcome(code=e.code().name, details=e.details())


async def _run_all(target: str, cases: list[Case], stagger_s: float) -> dict[str, CaseOutcome]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)

        async def run(i: int, case: Case) -> CaseOutcome:
            await asyncio.sleep(i * stagger_s)
            unary = asyncio.create_task(_unary(stub, case))
            stream = asyncio.create_task(_stream(stub, case)) if case.stream else None
            return CaseOutcome(await unary, await stream if stream is not None else None)

        outcomes = await asyncio.gather(*(run(i, c) for i, c in enumerate(cases)))
    return {c.name: o for c, o in zip(cases, outcomes, strict=True)}


def run_all(target: str, cases: list[Case], stagger_s: float = 0.02) -> dict[str, CaseOutcome]:
    """Run every case (and its stream twin) concurrently against `target` (host:port)."""
    return asyncio.run(_run_all(target, cases, stagger_s))
