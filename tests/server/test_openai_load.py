"""The HTTP port under hostile load, on the real server: a flood of streams beyond
MAX_CONCURRENT_REQUESTS, clients that stop reading, half-open connections and more
connections than HTTP_MAX_CONNECTIONS. One server process, small limits so each case is quick.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import statistics
import time
from collections.abc import Iterator

import grpc
import openai
import pytest

from engine.paths import model_path
from server.pb import generation_pb2 as pb
from server.pb import generation_pb2_grpc
from tests.reference import require_model
from tests.server.openai_helpers import async_client, client
from tools.server_process import ServerProcess
from training.prompts import CHAT_PROMPTS

MODEL = "tiny-llama-gqa-tied"
MAX_CONCURRENT = 64
MAX_CONNECTIONS = 600
HEADER_TIMEOUT_S = 3.0
BODY_TIMEOUT_S = 3.0
STALLED_TOKENS = 32
STALL_S = 30.0
ENV = {
    "MAX_SEQUENCE_LENGTH": "512",
    "KV_CACHE_BLOCKS": "2048",
    "MAX_BATCH_SIZE": "64",
    "MAX_CONCURRENT_REQUESTS": str(MAX_CONCURRENT),
    "HTTP_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
    "HTTP_HEADER_TIMEOUT_SECONDS": str(HEADER_TIMEOUT_S),
    "HTTP_BODY_TIMEOUT_SECONDS": str(BODY_TIMEOUT_S),
    "OMP_NUM_THREADS": "1",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    require_model(model_path(MODEL))
    log = tmp_path_factory.mktemp("openai-load") / "server.log"
    with ServerProcess(MODEL, ENV, log) as process:
        yield process


def _threads(server: ServerProcess) -> int:
    assert server.proc is not None
    return len(os.listdir(f"/proc/{server.proc.pid}/task"))


def _rss_bytes(server: ServerProcess) -> int:
    assert server.proc is not None
    with open(f"/proc/{server.proc.pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_500_streams_beyond_the_limit_get_429_and_the_rest_complete(
    server: ServerProcess,
) -> None:
    async def one(oai: openai.AsyncOpenAI, i: int) -> str:
        try:
            stream = await oai.completions.create(
                model=MODEL,
                prompt=CHAT_PROMPTS[i % 20],
                max_tokens=24,
                temperature=0,
                stream=True,
                extra_body={"min_tokens": 24},
            )
            finish = None
            async for chunk in stream:
                finish = chunk.choices[0].finish_reason or finish
            return "ok" if finish == "length" else f"unfinished {finish}"
        except openai.RateLimitError:
            return "429"
        except openai.APIStatusError as e:
            return "503" if e.status_code == 503 else f"status {e.status_code}"
        except Exception as e:  # anything else is a failure the test reports
            return f"{type(e).__name__}: {e}"

    async def flood() -> list[str]:
        oai = async_client(server)
        try:
            return await asyncio.gather(*(one(oai, i) for i in range(500)))
        finally:
            await oai.close()

    outcomes = asyncio.run(flood())
    counts = {o: outcomes.count(o) for o in set(outcomes)}
    assert set(counts) <= {"ok", "429", "503"}, counts
    assert counts.get("ok", 0) >= MAX_CONCURRENT and counts.get("429", 0) > 0, counts
    assert server.health() == 200


def test_grpc_and_http_share_max_concurrent_requests(server: ServerProcess) -> None:
    """gRPC streams holding every permit leave none for an HTTP request, and the reverse."""
    params = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=400, min_new_tokens=400))

    async def scenario() -> tuple[str, grpc.StatusCode | None]:
        async with grpc.aio.insecure_channel(server.grpc_target) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            calls = [
                stub.GenerateStream(
                    pb.SingleGenerationRequest(
                        request=pb.GenerationRequest(text=CHAT_PROMPTS[i % 20]), params=params
                    ),
                    timeout=120,
                )
                for i in range(MAX_CONCURRENT)
            ]
            for call in calls:
                await call.read()  # admitted: its first message came
            oai = async_client(server)
            try:
                await oai.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
                http = "ok"
            except openai.RateLimitError:
                http = "429"
            for call in calls:
                call.cancel()
            await asyncio.sleep(0.5)
            streams = await asyncio.gather(
                *(
                    oai.completions.create(
                        model=MODEL,
                        prompt="Hi",
                        max_tokens=400,
                        stream=True,
                        extra_body={"min_tokens": 400},
                    )
                    for _ in range(MAX_CONCURRENT)
                )
            )
            for stream in streams:
                await stream.__anext__()
            one = pb.BatchedGenerationRequest(
                requests=[pb.GenerationRequest(text="Hi")],
                params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=1)),
            )
            code = None
            try:
                await stub.Generate(one, timeout=60)
            except grpc.aio.AioRpcError as e:
                code = e.code()
            for stream in streams:
                await stream.close()
            await oai.close()
            return http, code

    http, code = asyncio.run(scenario())
    assert http == "429"
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED


def _stalled_stream(port: int) -> socket.socket:
    """A streamed completion whose client reads nothing: a tiny receive buffer, no recv."""
    body = json.dumps(
        {
            "model": MODEL,
            "prompt": CHAT_PROMPTS[3],
            "max_tokens": STALLED_TOKENS,
            "min_tokens": STALLED_TOKENS,
            "logprobs": 10,
            "stream": True,
        }
    ).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    sock.settimeout(60)
    data = bytearray()
    while part := sock.recv(1 << 16):
        data += part
    sock.close()
    return bytes(data)


def _timed_streams(server: ServerProcess, count: int) -> list[float]:
    oai = client(server)
    times = []
    for i in range(count):
        t0 = time.monotonic()
        stream = oai.completions.create(
            model=MODEL, prompt=CHAT_PROMPTS[i % 20], max_tokens=16, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in stream)
        times.append(time.monotonic() - t0)
    return times


def test_50_clients_that_stop_reading_cost_bounded_memory_and_slow_no_one(
    server: ServerProcess,
) -> None:
    baseline = statistics.median(_timed_streams(server, 8))
    for sock in [_stalled_stream(server.http_port) for _ in range(50)]:  # the same, read
        _read_all(sock)
    rss_before = _rss_bytes(server)
    prepared = server.metric("tgi_request_max_new_tokens_count")
    stalled = [_stalled_stream(server.http_port) for _ in range(50)]
    started = time.monotonic()
    try:
        # Measure the others once the stalled requests have run (busy seen, then idle).
        deadline = started + 120
        busy = False
        while True:
            assert time.monotonic() < deadline, "the stalled requests did not finish generating"
            running = server.metric("tgi_batch_current_size") + server.metric("tgi_queue_size")
            if server.metric("tgi_request_max_new_tokens_count") >= prepared + 50:
                busy = busy or running > 0
                if busy and running == 0:
                    break
            time.sleep(0.2)
        during = _timed_streams(server, 8)
        time.sleep(max(0.0, STALL_S - (time.monotonic() - started)))
        growth = _rss_bytes(server) - rss_before
    finally:
        replies = [_read_all(sock) for sock in stalled]
    # Against the same 50 requests read at once: what waits for a stalled client is at most
    # its whole response (32 tokens with 10 alternatives each, about 25 KiB of SSE text).
    print(f"RSS growth with 50 stalled clients: {growth / 2**20:.1f} MiB")
    assert growth < 50 * 1024 * 1024, f"RSS grew by {growth / 2**20:.1f} MiB"
    assert statistics.median(during) < 3 * baseline + 0.5, (baseline, during)
    for reply in replies:
        assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
        events = [line for line in reply.split(b"\n") if line.startswith(b"data: ")]
        assert events[-1] == b"data: [DONE]"
        last = json.loads(events[-2][6:])
        assert last["choices"][0]["finish_reason"] == "length"
        tokens = sum(
            len(json.loads(e[6:])["choices"][0]["logprobs"]["tokens"]) for e in events[:-1]
        )
        assert tokens == STALLED_TOKENS


def _connections(port: int, count: int, data: bytes) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        if data:
            sock.sendall(data)
        socks.append(sock)
    return socks


def _closed_by_server_within(socks: list[socket.socket], seconds: float) -> list[float]:
    """Each socket's time until the server closed it (recv -> b"" or reset); inf if not."""
    t0 = time.monotonic()
    closed = []
    for sock in socks:
        sock.settimeout(max(0.01, seconds - (time.monotonic() - t0)))
        try:
            data = sock.recv(1024)
            closed.append(time.monotonic() - t0 if data in (b"",) else float("inf"))
        except ConnectionResetError:
            closed.append(time.monotonic() - t0)
        except TimeoutError:
            closed.append(float("inf"))
        sock.close()
    return closed


def test_300_half_open_connections_are_closed_and_hold_no_threads(
    server: ServerProcess,
) -> None:
    threads_before = _threads(server)
    socks = _connections(server.http_port, 300, b"GET /health HTTP/1.1\r\nHost: x\r\n")
    assert server.health() == 200  # served meanwhile
    assert _threads(server) <= threads_before + 4
    closed = _closed_by_server_within(socks, HEADER_TIMEOUT_S + 10)
    assert max(closed) <= HEADER_TIMEOUT_S + 10, sorted(closed)[-5:]
    assert _threads(server) <= threads_before + 4


def test_a_body_that_stops_is_cut_off(server: ServerProcess) -> None:
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000\r\n\r\n{"model": '
    )
    socks = _connections(server.http_port, 20, head)
    closed = _closed_by_server_within(socks, BODY_TIMEOUT_S + 10)
    assert max(closed) <= BODY_TIMEOUT_S + 10


def test_connections_beyond_the_bound_are_closed_at_once(server: ServerProcess) -> None:
    socks = _connections(server.http_port, MAX_CONNECTIONS + 50, b"")
    try:
        time.sleep(0.5)
        refused = [t for t in _closed_by_server_within(socks[-50:], 2.0) if t < 2.0]
        assert len(refused) >= 40
    finally:
        for sock in socks:
            sock.close()
    deadline = time.monotonic() + 15
    while server.health() != 200:  # idle ones close at the header deadline
        assert time.monotonic() < deadline
        time.sleep(0.2)
