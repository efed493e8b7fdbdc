"""The TGIS-style integration suite: YAML cases against the real server
(docs/tgis-compatibility.md).

Each case file is served by its own server subprocess (`python -m server.main`, TGIS's test
limits: MAX_SEQUENCE_LENGTH 200, MAX_NEW_TOKENS 169, MAX_BATCH_SIZE 8). All cases of a file run
at once (client.py); then each case is one test, checked against its exact expected response,
its error, or the transformers oracle (oracle.py), and its GenerateStream twin against TGIS's
stream rules. The tiny random Llama serves the cases whose text does not matter;
SmolLM2 those whose text does (EOS, stop sequences).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import json_format

from engine.paths import DEFAULT_MODEL_NAME, model_path
from server.pb import generation_pb2 as pb
from server.pb import generation_pb2_grpc
from text_generation_tests.approx import assert_matches
from text_generation_tests.cases import Case, load_cases
from text_generation_tests.client import CaseOutcome, Outcome, run_all
from text_generation_tests.oracle import GenerationOracle, Limits, expected_tokenize
from tools.server_process import ServerProcess

HERE = Path(__file__).resolve().parent
MAX_SEQUENCE_LENGTH = 200
SERVER_ENV = {
    "MAX_SEQUENCE_LENGTH": str(MAX_SEQUENCE_LENGTH),
    "MAX_NEW_TOKENS": "169",
    "MAX_BATCH_SIZE": "8",
    "MAX_CONCURRENT_REQUESTS": "512",
}


@dataclass(frozen=True)
class Suite:
    case_file: str
    model: str
    env: dict[str, str]

    @property
    def model_dir(self) -> Path:
        return model_path(self.model)


SUITES = {
    "tiny_llama": Suite(
        "test_cases_tiny_llama.yaml",
        "tiny-llama-gqa-tied",
        {**SERVER_ENV, "KV_CACHE_BLOCKS": "1024", "OMP_NUM_THREADS": "1"},
    ),
    "smollm2": Suite(
        "test_cases_smollm2.yaml", DEFAULT_MODEL_NAME, {**SERVER_ENV, "KV_CACHE_BLOCKS": "256"}
    ),
}
CASES = {key: load_cases(HERE / s.case_file) for key, s in SUITES.items()}


class Runs:
    """Per suite, on first use: its server, its oracle and the outcome of all its cases."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.servers: dict[str, ServerProcess] = {}
        self.oracles: dict[str, GenerationOracle] = {}
        self.outcomes: dict[str, dict[str, CaseOutcome]] = {}

    def server(self, key: str) -> ServerProcess:
        if key not in self.servers:
            suite = SUITES[key]
            if not (suite.model_dir / "config.json").is_file():
                pytest.fail(f"{suite.model_dir} is missing: run `make models` first")
            log = self.log_dir / f"server-{key}.log"
            self.servers[key] = ServerProcess(suite.model_dir, suite.env, log).start()
        return self.servers[key]

    def oracle(self, key: str) -> GenerationOracle:
        if key not in self.oracles:
            self.oracles[key] = GenerationOracle(SUITES[key].model_dir, Limits(MAX_SEQUENCE_LENGTH))
        return self.oracles[key]

    def outcome(self, key: str, name: str) -> CaseOutcome:
        if key not in self.outcomes:
            self.outcomes[key] = run_all(self.server(key).grpc_target, CASES[key])
        return self.outcomes[key][name]

    def close(self) -> None:
        for server in self.servers.values():
            assert server.stop() == 0, f"server exited non-zero:\n{server.log_tail()}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    runs = Runs(tmp_path_factory.mktemp("integration"))
    try:
        yield runs
    finally:
        runs.close()


@pytest.mark.parametrize(
    ("suite", "case"),
    [(key, case) for key, cases in CASES.items() for case in cases],
    ids=[f"{key}:{case.name}" for key, cases in CASES.items() for case in cases],
)
def test_case(runs: Runs, suite: str, case: Case) -> None:
    outcome = runs.outcome(suite, case.name)
    if case.error is not None:
        for o in (outcome.unary, outcome.stream):
            if o is not None:
                assert (o.code, o.details) == case.error
        return
    if case.request_type == "tokenize":
        expected = case.response
        if case.oracle:
            expected = expected_tokenize(runs.oracle(suite).tokenizer, case.request)
        assert_matches(outcome.unary.response, expected)
        return
    expected = case.response
    if case.oracle:
        oracle = runs.oracle(suite)
        expected = {
            "responses": [oracle.expected(inp.get("text", ""), case.params) for inp in case.inputs]
        }
    assert expected is not None
    for i, facts in enumerate(case.expect):
        shown = {k: expected["responses"][i].get(k) for k in facts}
        assert shown == facts, f"input {i}: the expected response does not show {facts}"
    assert_matches(outcome.unary.response, expected)
    if outcome.stream is not None:
        check_stream(outcome.stream, expected["responses"][0], case)


def check_stream(outcome: Outcome, expected: dict[str, Any], case: Case) -> None:
    """TGIS's GenerateStream rules against the expected unary response
    (docs/tgis-compatibility.md, "Output")."""
    assert outcome.code is None, f"stream failed: {outcome.code}: {outcome.details}"
    response = json_format.ParseDict(case.params, pb.Parameters()).response
    input_text = case.inputs[0].get("text", "") if response.input_text else ""
    first, rest = outcome.messages[0], outcome.messages[1:]
    assert first.get("inputTokenCount", 0) == expected.get("inputTokenCount", 0)
    assert "generatedTokenCount" not in first and "stopReason" not in first
    assert first.get("text", "") == input_text
    if response.input_tokens:
        second, rest = rest[0], rest[1:]
        assert set(second) <= {"inputTokenCount", "inputTokens"}
        assert_matches(second["inputTokens"], expected["inputTokens"], "inputTokens")
    assert rest, "no generated-token messages"
    counts = [m.get("generatedTokenCount", 0) for m in rest]
    assert counts == sorted(set(counts)), f"generatedTokenCount not increasing: {counts}"
    for m in rest:
        assert "inputTokenCount" not in m and "inputTokens" not in m
    for m in rest[:-1]:
        assert "stopReason" not in m and "seed" not in m and "stopSequence" not in m
    last = rest[-1]
    assert counts[-1] == expected.get("generatedTokenCount", 0)
    assert last.get("stopReason") == expected["stopReason"]
    assert last.get("stopSequence") == expected.get("stopSequence")
    text = "".join(m.get("text", "") for m in rest)
    assert input_text + text == expected.get("text", "")
    tokens = [t for m in rest for t in m.get("tokens", [])]
    assert_matches(tokens, expected.get("tokens", []), "streamed tokens")


def test_multi_input_seeds(runs: Runs) -> None:
    """TGIS's seed test: identical SAMPLE inputs without a seed get independent 32-bit seeds,
    each returned with the text it gave. TGIS asks for 5 distinct texts, but the tiny random
    Llama's peaked distribution lets two seeds give the same 8 tokens now and then, so each
    text is checked against its seed instead: the same input sent alone with that seed gives
    it again."""
    server = runs.server("tiny_llama")
    params = {"method": "SAMPLE", "sampling": {"topK": 20}, "stopping": {"maxNewTokens": 8}}
    request = json_format.ParseDict(
        {"requests": [{"text": "Once upon a time"}] * 5, "params": params},
        pb.BatchedGenerationRequest(),
    )
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        responses = stub.Generate(request, timeout=60).responses
        assert len({r.seed for r in responses}) == 5
        assert all(0 <= r.seed <= 2**32 - 1 for r in responses)
        assert len({r.text for r in responses}) > 1
        for r in responses:
            alone = json_format.ParseDict(
                {
                    "requests": [{"text": "Once upon a time"}],
                    "params": {**params, "sampling": {"topK": 20, "seed": str(r.seed)}},
                },
                pb.BatchedGenerationRequest(),
            )
            (again,) = stub.Generate(alone, timeout=60).responses
            assert (again.text, again.seed) == (r.text, r.seed)
    assert server.metrics_text().startswith("#")
