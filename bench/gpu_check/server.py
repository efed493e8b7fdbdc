"""Section `server`: the real server on the device, one Generate and one GenerateStream over
gRPC (INFO when its gRPC extras or stubs are missing)."""

from __future__ import annotations

import importlib.util
import sys
import time
from typing import TYPE_CHECKING

from bench.gpu_check.models import TINY_MODELS, write_tiny_llama
from bench.gpu_check.report import REPO, Ctx, status

if TYPE_CHECKING:
    from tools.server_process import ServerProcess


SERVERS: list[ServerProcess] = []  # started by `server`; the watchdog kills them


def section_server(ctx: Ctx) -> None:
    r = ctx.report
    modules = ("grpc", "grpc_health", "grpc_reflection", "google.protobuf", "prometheus_client")
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    pb_dir = REPO / "server" / "pb"
    stubs = ("generation_pb2.py", "generation_pb2_grpc.py")
    have_stubs = all((pb_dir / s).is_file() for s in stubs)
    if not have_stubs and importlib.util.find_spec("grpc_tools") is None:
        missing.append("server/pb stubs (and grpc_tools to generate them)")
    if missing:
        r.detail("missing", missing)
        r.check("server.smoke", "skipped", "-", "INFO", missing=missing)
        return
    import grpc
    from google.protobuf import json_format

    from server.pb import generation_pb2 as pb
    from server.pb import generation_pb2_grpc
    from tools.server_process import ServerProcess

    spec = TINY_MODELS[1]
    folder = ctx.tmp / "server-model"
    write_tiny_llama(folder, spec)
    env = {"DEVICE": ctx.device, "KV_CACHE_BLOCKS": "512", "MAX_BATCH_SIZE": "8"}
    log = ctx.tmp / "server.log"
    process = ServerProcess(folder, env, log, python=sys.executable,
                            start_timeout_s=max(10.0, ctx.left() - 25))  # fmt: skip
    SERVERS.append(process)
    start = time.perf_counter()
    channel = None
    try:  # the server is stopped whatever happens, a section timeout included
        process.start()
        r.check("server.start", time.perf_counter() - start, "s", "INFO")
        channel = grpc.insecure_channel(process.grpc_target)
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        text = " ".join(f"w{i}" for i in range(5, 25))
        params = {"stopping": {"max_new_tokens": 8, "min_new_tokens": 8}}
        batch = json_format.ParseDict(
            {"requests": [{"text": text}], "params": params}, pb.BatchedGenerationRequest()
        )
        start = time.perf_counter()
        reply = stub.Generate(batch, timeout=30)
        r.check("server.generate", (time.perf_counter() - start) * 1e3, "ms", "INFO")
        tokens = reply.responses[0].generated_token_count
        r.check("server.generate.tokens", tokens, "tokens", status(tokens == 8))
        single = json_format.ParseDict(
            {"request": {"text": text}, "params": params}, pb.SingleGenerationRequest()
        )
        start = time.perf_counter()
        chunks = list(stub.GenerateStream(single, timeout=30))
        r.check("server.stream", (time.perf_counter() - start) * 1e3, "ms", "INFO")
        streamed = "".join(c.text for c in chunks)
        count = max((c.generated_token_count for c in chunks), default=0)
        r.check("server.stream.tokens", count, "tokens", status(count == 8))
        same = streamed == reply.responses[0].text
        r.check("server.stream_equals_generate", same, "-", status(same))
    finally:
        if channel is not None:
            channel.close()
        code = process.stop(stop_timeout_s=15)
        r.detail("server_log_tail", process.log_tail(2000))
        r.check("server.exit_code", code, "-", "INFO")
