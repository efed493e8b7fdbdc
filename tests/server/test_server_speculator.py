"""The server with SPECULATOR_PATH: same outputs as transformers, one stream message per token,
`tgi_spec_*` metrics, and a clear start-up refusal of a speculator that does not fit.

The per-token rules inside accepted runs are tested at the engine
(tests/unit/test_spec_decoding.py), which the server runs unchanged; here the wiring is checked end
to end.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch

from engine.paths import model_path
from engine.spec_decode.loader import write_draft_vocabulary
from server.pb import generation_pb2 as pb
from server.pb import generation_pb2_grpc
from tests.reference import compare_greedy, hf_greedy
from tools.server_process import ServerProcess
from tools.tiny_speculator import write_tiny_speculator
from training.prompts import CHAT_PROMPTS

MODEL = "tiny-llama-gqa-tied"
MAX_NEW = 24


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    spec = write_tiny_speculator(
        tmp_path_factory.mktemp("spec"), model_path(MODEL), n_predict=3, tie_weights=True
    )
    vocab_size = json.loads((model_path(MODEL) / "config.json").read_text())["vocab_size"]
    write_draft_vocabulary(spec, torch.arange(0, vocab_size, 2))  # drafts from even ids only
    env = {
        "SPECULATOR_PATH": str(spec),
        "SPECULATOR_TOP_K_TOKENS_PER_HEAD": "4,2,2",
        "SPECULATOR_N_CANDIDATES": "3",
        "KV_CACHE_BLOCKS": "64",
        "MAX_SEQUENCE_LENGTH": "256",
    }
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with ServerProcess(MODEL, env=env, log_path=log) as server:
        yield server


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_outputs_equal_transformers_and_streams_one_message_per_token(
    spec_server: ServerProcess,
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_path(MODEL)))
    prompts = CHAT_PROMPTS[:4]
    params = pb.Parameters(
        stopping=pb.StoppingCriteria(max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW),
        response=pb.ResponseOptions(generated_tokens=True, token_logprobs=True),
    )
    with grpc.insecure_channel(spec_server.grpc_target) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        response = stub.Generate(
            pb.BatchedGenerationRequest(
                requests=[pb.GenerationRequest(text=p) for p in prompts], params=params
            ),
            timeout=120,
        )
        stream = list(
            stub.GenerateStream(
                pb.SingleGenerationRequest(request=pb.GenerationRequest(text=prompts[0]),
                                           params=params),
                timeout=120,
            )
        )  # fmt: skip
    for prompt, result in zip(prompts, response.responses, strict=True):
        ids = tuple(tokenizer(prompt)["input_ids"])
        assert len(result.tokens) == result.generated_token_count == MAX_NEW
        ref = hf_greedy(model_path(MODEL), ids, MAX_NEW)
        ours_ids = tokenizer.convert_tokens_to_ids([t.text for t in result.tokens])
        compare_greedy(ours_ids, ref)
        assert result.stop_reason == pb.StopReason.MAX_TOKENS
    assert stream[0].input_token_count > 0 and not stream[0].tokens
    token_messages = stream[1:]
    assert [m.generated_token_count for m in token_messages] == list(range(1, MAX_NEW + 1))
    assert all(len(m.tokens) == 1 for m in token_messages)
    assert [m.tokens[0].text for m in token_messages] == [
        t.text for t in response.responses[0].tokens
    ]
    text = spec_server.metrics_text()
    steps = _metric(text, 'tgi_spec_steps_total{method="greedy"}')
    assert steps > 0
    assert _metric(text, 'tgi_spec_proposed_tokens_total{method="greedy"}') >= steps
    assert _metric(text, 'tgi_spec_head_proposed_total{head="0",method="greedy"}') == steps
    assert _metric(text, 'tgi_spec_tokens_per_step_count{method="greedy"}') == steps
    vocab_size = json.loads((model_path(MODEL) / "config.json").read_text())["vocab_size"]
    assert f"drafting from {vocab_size // 2} tokens" in spec_server.log_text()
    spec_steps = _metric(text, "tgi_spec_step_duration_count")
    assert 0 < spec_steps <= steps  # engine steps; a step may verify several requests' trees
    assert _metric(text, "tgi_kv_cache_blocks_used") == 0


def test_sampled_requests_speculate_with_plain_sampling_tokens(spec_server: ServerProcess) -> None:
    """Seeded and unseeded sampled requests sent concurrently with greedy ones (one batch):
    each gets the tokens plain sampling (the engine without a speculator) gives for its seed,
    the response's seed reproduces it, and the sampled requests' trees are counted under
    method="sample"."""
    from transformers import AutoTokenizer

    from engine import LLM

    tokenizer = AutoTokenizer.from_pretrained(str(model_path(MODEL)))
    sampled = [
        {"temperature": 0.7, "seed": 5},
        {"temperature": 1.0, "top_k": 20, "seed": 6},
        {"temperature": 0.3, "top_p": 0.9, "seed": 7},
        {"temperature": 1.0, "typical_p": 0.9, "seed": 8},
        {"temperature": 0.7, "top_k": 30, "top_p": 0.8},  # the server picks the seed
    ]
    prompts = CHAT_PROMPTS[4:14]
    stopping = pb.StoppingCriteria(max_new_tokens=MAX_NEW)
    before = spec_server.metrics_text()

    def one(i: int) -> pb.GenerationResponse:
        if i < len(sampled):
            params = pb.Parameters(
                method=pb.SAMPLE, sampling=pb.SamplingParameters(**sampled[i]), stopping=stopping
            )
        else:
            params = pb.Parameters(method=pb.GREEDY, stopping=stopping)
        params.response.generated_tokens = True
        request = pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=prompts[i])], params=params
        )
        with grpc.insecure_channel(spec_server.grpc_target) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            return stub.Generate(request, timeout=120).responses[0]

    with ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(one, range(len(prompts))))
    plain = LLM(model_path(MODEL), dtype="float32")
    for i, params in enumerate(sampled):
        result = responses[i]
        assert result.seed and result.seed == params.get("seed", result.seed)
        ours = tokenizer.convert_tokens_to_ids([t.text for t in result.tokens])
        fields = {k: v for k, v in params.items() if k != "seed"}
        (ref,) = plain.generate([prompts[i]], MAX_NEW, seed=result.seed, **fields)
        assert ours == ref.token_ids, params
    for i in range(len(sampled), len(prompts)):
        ours = tokenizer.convert_tokens_to_ids([t.text for t in responses[i].tokens])
        ids = tuple(tokenizer(prompts[i])["input_ids"])
        compare_greedy(ours, hf_greedy(model_path(MODEL), ids, MAX_NEW))
    after = spec_server.metrics_text()
    name = 'tgi_spec_steps_total{method="sample"}'
    assert _metric(after, name) > (_metric(before, name) if name in before else 0)


def _start_fails(env: dict[str, str], tmp_path: Path) -> str:
    """The output of a server that must refuse to start; only PATH is inherited."""
    server = ServerProcess(
        MODEL,
        {"PATH": "/usr/bin:/bin", **env},
        tmp_path / "refused.log",
        start_timeout_s=120,
        inherit_env=False,
    )
    assert server.run_to_exit() != 0
    return server.log_text()


def test_mismatched_speculator_is_refused_at_startup(tmp_path: Path) -> None:
    base = model_path(MODEL)
    hidden = int(json.loads((base / "config.json").read_text())["hidden_size"])
    wide = write_tiny_speculator(tmp_path / "wide", base, emb_dim=hidden + 16)
    out = _start_fails({"SPECULATOR_PATH": str(wide)}, tmp_path)
    assert f"speculator emb_dim {hidden + 16} does not match the base model's hidden_size " in out
    small = write_tiny_speculator(tmp_path / "small", base, vocab_size=1000)
    out = _start_fails({"SPECULATOR_NAME": str(small)}, tmp_path)
    assert "speculator vocab_size 1000 does not match the base model's vocab_size 49152" in out
    good = write_tiny_speculator(tmp_path / "good", base)
    out = _start_fails({"SPECULATOR_PATH": str(good), "SPECULATOR_THRESHES": "5,3"}, tmp_path)
    assert "top_k_tokens_per_head [5, 3] must have n_predict (3) entries" in out
    out = _start_fails({"SPECULATOR_PATH": str(tmp_path / "missing")}, tmp_path)
    assert f"{tmp_path / 'missing'}: speculator path does not exist" in out
    assert f"loaded {MODEL} (" not in out  # refused before the base model's weights load


def test_model_without_tokenizer_is_refused_naming_its_folder(tmp_path: Path) -> None:
    """A model folder holding config and weights but no tokenizer files."""
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    for f in model_path(MODEL).iterdir():
        if f.name == "config.json" or f.suffix == ".safetensors":
            (folder / f.name).symlink_to(f)
    server = ServerProcess(
        folder, {"PATH": "/usr/bin:/bin"}, tmp_path / "refused.log", inherit_env=False
    )
    assert server.run_to_exit() != 0
    assert f"{folder}: cannot load the tokenizer" in server.log_text()
