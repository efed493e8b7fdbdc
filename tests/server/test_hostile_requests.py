"""The real server against requests that used to get more than they should: a DecodingMethod
number the proto does not define (sent as raw bytes: proto3 keeps it) is refused instead of
running as GREEDY, and prompt-store ids whose files are links out of the store or to a FIFO or
a device are refused as unknown ids (links inside the store work)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from server.pb import generation_pb2 as pb
from tests.server.grpc_helpers import Server, running_server
from tests.unit.test_prompt_prefix import random_prefix

MODEL = "tiny-llama-gqa-tied"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("prefixes")
    root, outside = base / "store", base / "outside"
    root.mkdir()
    outside.mkdir()
    torch.save(random_prefix(4, 31), root / "tuned.pt")
    torch.save(random_prefix(4, 32), outside / "secret.pt")
    (root / "escape.pt").symlink_to(outside / "secret.pt")
    (root / "zero.pt").symlink_to("/dev/zero")
    os.mkfifo(root / "fifo")
    (root / "pipe.pt").symlink_to(root / "fifo")
    (root / "alias.pt").symlink_to("tuned.pt")
    return root


@pytest.fixture(scope="module")
def server(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    env = {
        "PREFIX_STORE_PATH": str(store),
        "MAX_SEQUENCE_LENGTH": "64",
        "KV_CACHE_BLOCKS": "32",
        "OMP_NUM_THREADS": "1",
    }
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with running_server(MODEL, env, log) as server:
        yield server


def _raw_request(method: int) -> bytes:
    """A Generate request whose params hold only `method`, encoded by hand (field 10: params;
    its field 1: method, a varint)."""
    batch = pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="Hello")])
    params = bytes([1 << 3 | 0, method])
    return batch.SerializeToString() + bytes([10 << 3 | 2, len(params)]) + params


def _status(call: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()  # type: ignore[operator]
    return info.value.code(), str(info.value.details())


def test_unknown_decoding_method_is_refused(server: Server) -> None:
    generate = server.channel.unary_unary("/fmaas.GenerationService/Generate")
    stream = server.channel.unary_stream("/fmaas.GenerationService/GenerateStream")
    assert pb.BatchedGenerationRequest.FromString(_raw_request(5)).params.method == 5
    assert generate(_raw_request(1), timeout=60)  # SAMPLE, the same bytes otherwise
    refused = (grpc.StatusCode.INVALID_ARGUMENT, "method (5) must be GREEDY (0) or SAMPLE (1)")
    assert _status(lambda: generate(_raw_request(5), timeout=10)) == refused
    single = pb.SingleGenerationRequest(request=pb.GenerationRequest(text="Hi"))
    raw = single.SerializeToString() + bytes([10 << 3 | 2, 2, 1 << 3 | 0, 5])
    assert _status(lambda: list(stream(raw, timeout=10))) == refused


@pytest.mark.parametrize("prefix_id", ["escape", "zero", "pipe"])
def test_links_out_of_the_store_and_to_non_files_are_unknown_ids(
    server: Server, prefix_id: str
) -> None:
    request = pb.BatchedGenerationRequest(
        prefix_id=prefix_id, requests=[pb.GenerationRequest(text="Hello")]
    )
    assert _status(lambda: server.stub.Generate(request, timeout=30)) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        f"can't retrieve prompt prefix with id '{prefix_id}': prefix id \"{prefix_id}\" not found",
    )


def test_a_link_inside_the_store_works(server: Server) -> None:
    """`alias.pt` links to `tuned.pt`, both in the store: the same prefix."""

    def texts(prefix_id: str) -> list[str]:
        request = pb.BatchedGenerationRequest(
            prefix_id=prefix_id,
            requests=[pb.GenerationRequest(text="The capital of France is")],
            params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=6)),
        )
        return [r.text for r in server.stub.Generate(request, timeout=60).responses]

    assert texts("alias") == texts("tuned")
