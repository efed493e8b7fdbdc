"""The server on each model family's tiny checkpoint (tests/families.py), a random speculator
drafting: greedy tokens through gRPC equal transformers', Mistral's max_sequence_length is
capped at its sliding window, and a config.json the engine cannot serve ends start-up with one
clear error line and exit code 1."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from transformers import AutoTokenizer

from server.pb import generation_pb2 as pb
from server.pb import generation_pb2_grpc
from tests.families import MAX_NEW_TOKENS, MAX_POSITIONS, SLIDING_WINDOW, checkpoint, retype
from tests.reference import compare_greedy, hf_greedy
from tools.server_process import ServerProcess
from tools.tiny_speculator import write_tiny_speculator
from training.prompts import CHAT_PROMPTS, chat_texts

NUM_PROMPTS = 2
REFUSAL_SECONDS = 10.0


@pytest.mark.parametrize("variant", ["llama", "granite", "mistral", "qwen2"])
def test_greedy_over_grpc_matches_transformers(variant: str, tmp_path: Path) -> None:
    """The prompts are chat turns rendered as text (the same token ids as the offline test's)."""
    path = checkpoint(variant)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    params = pb.Parameters(
        stopping=pb.StoppingCriteria(max_new_tokens=MAX_NEW_TOKENS),
        response=pb.ResponseOptions(generated_tokens=True),
    )
    texts = chat_texts(tokenizer, CHAT_PROMPTS[:NUM_PROMPTS])
    requests = [pb.GenerationRequest(text=text) for text in texts]
    speculator = write_tiny_speculator(tmp_path / "speculator", path, n_predict=3)
    env = {
        "KV_CACHE_BLOCKS": "64",
        "SPECULATOR_PATH": str(speculator),
        "SPECULATOR_ADAPTIVE": "false",
    }
    with ServerProcess(path, env=env, log_path=tmp_path / "server.log") as server:
        with grpc.insecure_channel(server.grpc_target) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            response = stub.Generate(
                pb.BatchedGenerationRequest(requests=requests, params=params), timeout=120
            )
            info = stub.ModelInfo(pb.ModelInfoRequest(), timeout=30)
        log = server.log_text()
        assert server.metric('tgi_spec_steps_total{method="greedy"}', 0.0) > 0
    for text, result in zip(texts, response.responses, strict=True):
        ref = hf_greedy(path, tuple(tokenizer(text)["input_ids"]), MAX_NEW_TOKENS)
        compare_greedy(tokenizer.convert_tokens_to_ids([t.text for t in result.tokens]), ref)
    if variant == "mistral":
        assert info.max_sequence_length == SLIDING_WINDOW
        assert f"capped at {SLIDING_WINDOW}, the mistral model's sliding_window" in log
        assert f"max_sequence_length {MAX_POSITIONS} lowered to {SLIDING_WINDOW}" in log
    else:
        assert info.max_sequence_length == MAX_POSITIONS


@pytest.mark.parametrize(
    ("source", "model_type", "message"),
    [
        (
            "llama",
            "gpt2",
            "model_type 'gpt2' is not supported; supported model types: llama, granite, "
            "mistral, qwen2",
        ),
        (
            "granite",
            "llama",
            "model_type 'llama' does not read embedding_multiplier, residual_multiplier, "
            "attention_multiplier, logits_scaling (Granite's multipliers), which this config "
            "sets: if it is a Granite checkpoint, set model_type to 'granite'",
        ),
    ],
    ids=["gpt2", "granite-as-llama"],
)
def test_unservable_config_stops_start_up(
    source: str, model_type: str, message: str, tmp_path: Path
) -> None:
    folder = retype(checkpoint(source), tmp_path / "model", model_type)
    server = ServerProcess(folder, log_path=tmp_path / "server.log")
    start = time.monotonic()
    code = server.run_to_exit()
    elapsed = time.monotonic() - start
    assert code == 1, server.log_tail()
    assert message in server.log_text()
    assert elapsed < REFUSAL_SECONDS, f"start-up took {elapsed:.1f} s to refuse"
