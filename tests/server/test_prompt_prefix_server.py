"""The server with PREFIX_STORE_PATH: a `.pt` prefix and a PEFT folder give transformers'
output for the same `inputs_embeds`, through Generate and GenerateStream; unknown, escaping and
malformed ids get TGIS's messages; the prefix counts toward the input length only."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from transformers import AutoTokenizer

from engine.paths import model_path
from server.pb import generation_pb2 as pb
from server.pb import generation_pb2_grpc
from tests.reference import compare_greedy, hf_greedy_with_prefix, require_model
from tests.unit.test_prompt_prefix import random_prefix, write_peft_folder
from tools.server_process import ServerProcess

MODEL = "tiny-llama-gqa-tied"
MAX_NEW = 10
MAX_SEQ = 64
PROMPTS = ["The capital of France is", "Once upon a time"]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("prefixes")
    torch.save(random_prefix(6, 21), root / "tuned.pt")
    write_peft_folder(root / "team" / "peft", random_prefix(9, 22))
    torch.save(torch.randn(4, 32), root / "wide.pt")
    return root


@pytest.fixture(scope="module")
def server(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    require_model(model_path(MODEL))
    env = {
        "PREFIX_STORE_PATH": str(store),
        "MAX_SEQUENCE_LENGTH": str(MAX_SEQ),
        "KV_CACHE_BLOCKS": "64",
        "OMP_NUM_THREADS": "1",
    }
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with ServerProcess(MODEL, env=env, log_path=log) as server:
        yield server


@pytest.fixture(scope="module")
def stub(server: ServerProcess) -> Iterator[Any]:
    with grpc.insecure_channel(server.grpc_target) as channel:
        yield generation_pb2_grpc.GenerationServiceStub(channel)


def _params() -> pb.Parameters:
    return pb.Parameters(
        stopping=pb.StoppingCriteria(max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW),
        response=pb.ResponseOptions(generated_tokens=True),
    )


@pytest.mark.parametrize(("prefix_id", "embeds"), [("tuned", "tuned.pt"), ("team/peft", None)])
def test_output_equals_transformers(
    stub: Any, store: Path, prefix_id: str, embeds: str | None
) -> None:
    if embeds is not None:
        prefix = torch.load(store / embeds)
    else:
        from safetensors.torch import load_file

        prefix = load_file(store / prefix_id / "adapter_model.safetensors")["prompt_embeddings"]
    tokenizer = AutoTokenizer.from_pretrained(str(model_path(MODEL)))
    request = pb.BatchedGenerationRequest(
        prefix_id=prefix_id,
        requests=[pb.GenerationRequest(text=p) for p in PROMPTS],
        params=_params(),
    )
    response = stub.Generate(request, timeout=120)
    stream = list(
        stub.GenerateStream(
            pb.SingleGenerationRequest(
                prefix_id=prefix_id, request=pb.GenerationRequest(text=PROMPTS[0]), params=_params()
            ),
            timeout=120,
        )
    )
    for text, out in zip(PROMPTS, response.responses, strict=True):
        ids = list(tokenizer(text)["input_ids"])
        assert out.input_token_count == len(ids)  # the prefix's virtual tokens excluded
        ours = tokenizer.convert_tokens_to_ids([t.text for t in out.tokens])
        compare_greedy(ours, hf_greedy_with_prefix(model_path(MODEL), prefix, ids, MAX_NEW))
    assert "".join(m.text for m in stream) == response.responses[0].text


def _invalid(call: Any) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    return str(info.value.details())


@pytest.mark.parametrize(
    ("prefix_id", "reason"),
    [
        ("nope", 'prefix id "nope" not found'),
        ("../tuned", "Invalid prefix id ../tuned, must contain only alphanumeric, _ and - and /"),
        ("/tmp", "Invalid prefix id /tmp"),
        ("wide", "Prefix embedding tensor dim 32 does not match model (64)"),
    ],
)
def test_lookup_failures_get_tgis_messages(
    server: ServerProcess, stub: Any, prefix_id: str, reason: str
) -> None:
    before = server.metric("tgi_prompt_load_failure_total", 0)
    request = pb.BatchedGenerationRequest(
        prefix_id=prefix_id, requests=[pb.GenerationRequest(text="Hi")]
    )
    message = _invalid(lambda: stub.Generate(request, timeout=30))
    assert message == f"can't retrieve prompt prefix with id '{prefix_id}': {reason}"
    single = pb.SingleGenerationRequest(
        prefix_id=prefix_id, request=pb.GenerationRequest(text="Hi")
    )
    assert _invalid(lambda: list(stub.GenerateStream(single, timeout=30))) == message
    assert server.metric("tgi_prompt_load_failure_total") == before + 2


def test_prefix_counts_toward_the_input_length(server: ServerProcess, stub: Any) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(model_path(MODEL)))
    text = " ".join(["word"] * 80)
    n = len(tokenizer(text)["input_ids"])
    request = pb.BatchedGenerationRequest(
        prefix_id="tuned",
        requests=[pb.GenerationRequest(text=text)],
        params=pb.Parameters(truncate_input_tokens=MAX_SEQ - 6),
    )
    message = _invalid(lambda: stub.Generate(request, timeout=30))
    assert n > MAX_SEQ
    assert message == f"input tokens ({MAX_SEQ - 6}) plus prefix length (6) must be < {MAX_SEQ}"
    details = pb.BatchedGenerationRequest(
        prefix_id="tuned",
        requests=[pb.GenerationRequest(text="Hi")],
        params=pb.Parameters(response=pb.ResponseOptions(input_tokens=True, token_logprobs=True)),
    )
    assert "not supported with a prefix_id" in _invalid(lambda: stub.Generate(details, timeout=30))
    assert server.metric("tgi_prompt_load_duration_count") >= 1
