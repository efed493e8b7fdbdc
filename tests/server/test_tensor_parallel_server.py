"""The server with NUM_SHARD > 1 on CPU (gloo): greedy tokens through gRPC equal the one-shard
engine's (near-ties counted), a killed rank stops the server within 30 s naming the rank, and
SIGTERM under load drains, exits 0 and leaves no rank behind."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from functools import cache
from pathlib import Path

import grpc
import pytest
from transformers import AutoTokenizer

from engine.llm import LLM
from engine.paths import default_model_path, model_path
from server.pb import generation_pb2 as pb
from server.pb import generation_pb2_grpc
from tests.reference import Reference, compare_greedy, require_model
from tools.server_process import ServerProcess, free_port
from tools.tiny_speculator import write_tiny_speculator

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land"]
MAX_NEW_TOKENS = 16
CASES = [
    ("tiny-llama-gqa-tied", 2, True),
    ("tiny-llama-mha-untied", 4, False),
    ("SmolLM2-135M-Instruct", 3, True),
]


def _path(name: str) -> Path:
    if name == default_model_path().name:
        return require_model(default_model_path())
    return require_model(model_path(name))


@cache
def _one_shard(name: str) -> tuple[Reference, ...]:
    with LLM(_path(name), max_num_tokens=1024) as llm:
        outputs = llm.generate(PROMPTS, MAX_NEW_TOKENS, return_logits=True)
    return tuple(Reference(o.token_ids, o.logits) for o in outputs)


def _env(num_shards: int, **extra: str) -> dict[str, str]:
    return {"NUM_SHARD": str(num_shards), "MASTER_PORT": str(free_port()), **extra}


def _rank_pids(server: ServerProcess) -> dict[int, int]:
    found = re.findall(r"tensor parallelism: rank (\d+) is process (\d+)", server.log_text())
    return {int(rank): int(pid) for rank, pid in found}


def _gone(pid: int) -> bool:
    """The process has exited (absent, or a zombie nobody has reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _all_gone(pids: list[int], timeout_s: float = 10.0) -> bool:
    """Whether every process in `pids` exits within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return all(_gone(pid) for pid in pids)


@pytest.mark.parametrize(
    ("name", "num_shards", "speculate"), CASES, ids=[f"{n}-{k}" for n, k, _ in CASES]
)
def test_greedy_over_grpc_matches_one_shard(
    name: str, num_shards: int, speculate: bool, tmp_path: Path
) -> None:
    path = _path(name)
    env = _env(num_shards)
    if speculate:
        speculator = write_tiny_speculator(tmp_path / "speculator", path, n_predict=3)
        env |= {"SPECULATOR_PATH": str(speculator), "SPECULATOR_ADAPTIVE": "false"}
    params = pb.Parameters(
        stopping=pb.StoppingCriteria(max_new_tokens=MAX_NEW_TOKENS),
        response=pb.ResponseOptions(generated_tokens=True),
    )
    requests = [pb.GenerationRequest(text=text) for text in PROMPTS]
    with ServerProcess(path, env=env, log_path=tmp_path / "server.log") as server:
        assert sorted(_rank_pids(server)) == list(range(1, num_shards))
        with grpc.insecure_channel(server.grpc_target) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            response = stub.Generate(
                pb.BatchedGenerationRequest(requests=requests, params=params), timeout=120
            )
        spec_steps = server.metric('tgi_spec_steps_total{method="greedy"}', 0.0)
    assert (spec_steps > 0) == speculate
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    near_ties = 0
    for ref, result in zip(_one_shard(name), response.responses, strict=True):
        ours = tokenizer.convert_tokens_to_ids([t.text for t in result.tokens])
        near_ties += compare_greedy(ours, ref)
    print(f"{name} x{num_shards} over gRPC: {near_ties} near-ties")


def test_a_number_of_shards_that_does_not_split_the_model_stops_start_up(tmp_path: Path) -> None:
    server = ServerProcess(
        _path("SmolLM2-135M-Instruct"), env=_env(2), log_path=tmp_path / "server.log"
    )
    assert server.run_to_exit() == 1
    assert (
        "2 shards cannot split the llama model evenly: its 9 attention heads, its 3 KV heads "
        "(neither divides the other); choose a number of shards that divides them"
        in server.log_text()
    )
    assert not _rank_pids(server)  # refused before any rank started


def test_a_killed_rank_stops_the_server_naming_it(tmp_path: Path) -> None:
    path = _path("tiny-llama-gqa-tied")
    termination_log = tmp_path / "termination-log"
    env = _env(2, TERMINATION_LOG_PATH=str(termination_log))
    server = ServerProcess(path, env=env, log_path=tmp_path / "server.log").start()
    try:
        (rank1,) = _rank_pids(server).values()
        killed = time.monotonic()
        os.kill(rank1, signal.SIGKILL)
        code = server.wait(timeout_s=30)
        assert time.monotonic() - killed < 30
    finally:
        server.stop()
    assert code == 1
    assert "shard rank 1 was killed by SIGKILL" in server.log_text()
    assert termination_log.read_text().strip() == "shard rank 1 was killed by SIGKILL"


def test_a_hung_rank_stops_the_server_after_the_shard_timeout(tmp_path: Path) -> None:
    path = _path("tiny-llama-gqa-tied")
    env = _env(2, SHARD_TIMEOUT_SECONDS="3")
    server = ServerProcess(path, env=env, log_path=tmp_path / "server.log").start()
    try:
        (rank1,) = _rank_pids(server).values()
        os.kill(rank1, signal.SIGSTOP)
        hung = time.monotonic()
        with grpc.insecure_channel(server.grpc_target) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            request = pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="Hi")])
            with pytest.raises(grpc.RpcError):
                stub.Generate(request, timeout=60)
        code = server.wait(timeout_s=30)
        assert time.monotonic() - hung < 30
    finally:
        server.stop()
    assert code == 1
    assert "Timed out waiting 3000ms" in server.log_text()
    assert _all_gone([rank1])


def test_sigterm_under_load_drains_and_stops_every_rank(tmp_path: Path) -> None:
    path = _path("tiny-llama-gqa-tied")
    server = ServerProcess(path, env=_env(4), log_path=tmp_path / "server.log")
    server.start()
    ranks = _rank_pids(server)
    params = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=48, min_new_tokens=48))
    counts: list[int] = []
    errors: list[grpc.StatusCode] = []
    first_tokens = threading.Barrier(5, timeout=60)

    def stream() -> None:
        with grpc.insecure_channel(server.grpc_target) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            request = pb.SingleGenerationRequest(
                request=pb.GenerationRequest(text="Once upon a time"), params=params
            )
            total, waited = 0, False
            try:
                for message in stub.GenerateStream(request, timeout=120):
                    total += message.generated_token_count - total
                    if total and not waited:
                        waited = True
                        first_tokens.wait()
                counts.append(total)
            except grpc.RpcError as e:
                errors.append(e.code())

    threads = [threading.Thread(target=stream) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        first_tokens.wait()  # every stream is generating
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout_s=60)
    finally:
        server.stop()
    for t in threads:
        t.join(timeout=60)
    assert code == 0
    assert counts == [48] * 4 and not errors  # in-flight requests finished within the grace
    assert sorted(ranks) == [1, 2, 3] and _all_gone(list(ranks.values()))
