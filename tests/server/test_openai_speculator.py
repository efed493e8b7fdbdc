"""The HTTP API on a server with a speculator (tools/tiny_speculator.py): greedy chat through
HTTP equals the gRPC output for the chat template applied by hand, and a seeded sampled chat
gives the same text through both APIs, so speculation serves both the same way."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from transformers import AutoTokenizer

from engine.paths import model_path
from tests.server.grpc_helpers import Server, running_server, single_request
from tests.server.openai_helpers import client
from tools.tiny_speculator import write_tiny_speculator
from training.prompts import CHAT_PROMPTS

MODEL = "tiny-llama-gqa-tied"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    spec = write_tiny_speculator(
        tmp_path_factory.mktemp("spec"), model_path(MODEL), n_predict=3, tie_weights=True
    )
    env = {
        "SPECULATOR_PATH": str(spec),
        "SPECULATOR_TOP_K_TOKENS_PER_HEAD": "4,2,2",
        "SPECULATOR_N_CANDIDATES": "3",
        "SPECULATOR_ADAPTIVE": "false",
        "KV_CACHE_BLOCKS": "64",
        "MAX_SEQUENCE_LENGTH": "256",
        "OMP_NUM_THREADS": "1",
    }
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with running_server(MODEL, env, log) as server:
        yield server


def _grpc_text(server: Server, text: str, params: dict[str, Any]) -> str:
    messages = server.stub.GenerateStream(single_request(text, params), timeout=120)
    return "".join(m.text for m in messages)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_chat_equals_grpc_with_a_speculator(server: Server, sampled: bool) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(model_path(MODEL)))
    oai = client(server.process)
    before = server.process.metric('tgi_spec_steps_total{method="greedy"}', 0.0)
    for i, prompt in enumerate(CHAT_PROMPTS[:3]):
        messages = [{"role": "user", "content": prompt}]
        kwargs: dict[str, Any] = {"temperature": 0}
        params: dict[str, Any] = {"stopping": {"maxNewTokens": 24}}
        if sampled:
            kwargs = {"temperature": 0.8, "seed": 100 + i}
            params["method"] = "SAMPLE"
            params["sampling"] = {"temperature": 0.8, "seed": 100 + i}
        reply = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, **kwargs)
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert reply.choices[0].message.content == _grpc_text(server, text, params)
    if not sampled:
        assert server.process.metric('tgi_spec_steps_total{method="greedy"}') > before
