"""Seeded fuzz of `Parameters` against the real server: no request can harm another.

About 200 random Parameters (valid values, boundaries, extremes such as 0, 2**31-1, 2**32-1,
2**64-1, 1e-38, 1e-30, 1e30, 3e38, and NaN/+-inf) go through Generate and GenerateStream from a
thread pool while innocent greedy requests run in a loop next to them. Every innocent must return
its solo output; every fuzz request must end with OK or INVALID_ARGUMENT (one drawn from valid
values only must end OK); afterwards /health answers 200, the KV pool is empty and the log holds
no traceback. Half the requests are drawn valid; the other half get one or two fields corrupted.

The seed is SPECSERVE_FUZZ_SEED (default 16); the summary line (`pytest -s`) prints it.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from server.pb import generation_pb2 as pb
from tests.server.grpc_helpers import (
    Server,
    batch_request,
    generate_texts,
    running_server,
    single_request,
    stream_text,
)
from training.prompts import CHAT_PROMPTS

MODEL = "tiny-llama-gqa-tied"
SEED = int(os.environ.get("SPECSERVE_FUZZ_SEED", "16"))
NUM_RANDOM = 180
MAX_SEQ = 128
SERVER_MAX_NEW = MAX_SEQ - 1  # the server clamps MAX_NEW_TOKENS to max_sequence_length - 1
ENV = {
    "KV_CACHE_BLOCKS": "512",
    "MAX_SEQUENCE_LENGTH": str(MAX_SEQ),
    "MAX_NEW_TOKENS": "100000",
    "MAX_BATCH_SIZE": "8",
    "MAX_CONCURRENT_REQUESTS": "64",
    "OMP_NUM_THREADS": "1",
}
FUZZ_WORKERS = 12
INNOCENT_PROMPTS = CHAT_PROMPTS[:4]
INNOCENT_WORKERS = 4
INNOCENT = {"stopping": {"max_new_tokens": 20}}
MAX_FUZZ_NEW = 30
"""The largest max_new_tokens / min_new_tokens of a valid draw, but for a few SERVER_MAX_NEW."""
LONG_PROMPT = "word " * 150  # more than MAX_SEQ tokens: valid only with truncate_input_tokens

NAN, INF, NEG_INF = "NaN", "Infinity", "-Infinity"  # json_format parses these to float specials
NON_FINITE = [NAN, INF, NEG_INF]
I32 = 2**31 - 1
U32 = 2**32 - 1
U64 = 2**64 - 1

Pool = tuple[list[Any], list[Any]]
"""Valid and invalid values of one field, as server/validation.py judges the field alone."""
TEMPERATURE: Pool = ([0.0, 0.05, 0.3, 0.7, 1.0, 1.5, 1e30, 3e38], [0.049, 1e-30, -1.0, *NON_FINITE])
TOP_K: Pool = ([0, 1, 2, 50, 1000, I32], [I32 + 1, U32])
TOP_P: Pool = ([0.0, 1e-30, 0.05, 0.5, 0.95, 1.0], [-0.5, -1e-30, 1.0001, 1e30, *NON_FINITE])
TYPICAL_P: Pool = ([0.0, 1e-30, 0.2, 0.9, 1.0, -1.0, -1e30], [1.0001, 1e30, *NON_FINITE])
SEEDS = [0, 1, 42, I32, U32, U64]
EDGE_PENALTIES = [1e-38, 3e38]
"""Finite repetition penalties at float32's ends (a logit / 1e-38 overflows): the server may
reject them (INVALID_ARGUMENT) or serve them (OK), but nothing else."""
REPETITION_PENALTY: Pool = (
    [0.0, -0.0, 1e-30, 0.5, 1.0, 1.2, 2.0, 1e30, *EDGE_PENALTIES],
    [-1.0, -1e-30, *NON_FINITE],
)
START_INDEX = [0, 1, 5, 29, I32, U32]
DECAY_FACTOR: Pool = (
    [1.0, 1.0001, 2.0, 9.9999, 10.0],
    [0.0, 0.9999, 10.001, -1.0, 1e-30, 1e30, *NON_FINITE],
)
MAX_NEW_TOKENS: Pool = ([0, 1, 2, 5, 10, 20, MAX_FUZZ_NEW], [SERVER_MAX_NEW + 1, 1000, I32, U32])
TIME_LIMIT_MILLIS = [0, 1, 10, 200, I32, U32]
STOP_SEQUENCES: Pool = (
    [".", "a", "\n", " the", "é" * 120, "🙂", "</s>", "x" * 240],
    ["", "x" * 241, "é" * 121],
)
TOP_N_TOKENS: Pool = ([0, 1, 5, 10], [11, U32])
TRUNCATE = [0, 1, 2, 5, 64, I32, U32]
FLAGS = ["input_text", "generated_tokens", "input_tokens", "token_logprobs", "token_ranks"]
CORRUPTIONS = [
    "temperature",
    "top_k",
    "top_p",
    "typical_p",
    "repetition_penalty",
    "decay_factor",
    "max_new_tokens",
    "min_new_tokens",
    "stop_sequences",
    "top_n_tokens",
    "token_detail",
    "long_input",
]


@dataclass
class Case:
    name: str
    rpc: str  # "generate" or "stream"
    texts: list[str]
    params: dict[str, Any]
    expect: str | None  # "ok", "invalid", or None: either


@dataclass
class Outcome:
    code: grpc.StatusCode
    message: str
    problem: str | None = None  # an OK call whose responses are wrong


def valid_params(rng: random.Random) -> dict[str, Any]:
    """Parameters that validation accepts for a short prompt."""
    params: dict[str, Any] = {}
    sample = rng.random() < 0.5
    if sample:
        params["method"] = "SAMPLE"
    if sample or rng.random() < 0.2:  # GREEDY ignores `sampling`
        sampling: dict[str, Any] = {}
        for name, (valid, _) in (
            ("temperature", TEMPERATURE),
            ("top_k", TOP_K),
            ("top_p", TOP_P),
            ("typical_p", TYPICAL_P),
        ):
            if rng.random() < 0.5:
                sampling[name] = rng.choice(valid)
        if rng.random() < 0.7:
            sampling["seed"] = rng.choice(SEEDS)
        params["sampling"] = sampling
    decoding: dict[str, Any] = {}
    if rng.random() < 0.4:
        decoding["repetition_penalty"] = rng.choice(REPETITION_PENALTY[0])
    if rng.random() < 0.4:
        decoding["length_penalty"] = {
            "start_index": rng.choice(START_INDEX),
            "decay_factor": rng.choice(DECAY_FACTOR[0]),
        }
    if decoding or rng.random() < 0.1:
        params["decoding"] = decoding
    stopping: dict[str, Any] = {}
    if rng.random() < 0.97:
        stopping["max_new_tokens"] = rng.choice(MAX_NEW_TOKENS[0])
    else:
        stopping["max_new_tokens"] = SERVER_MAX_NEW  # clamped to what the prompt leaves
    if rng.random() < 0.5:
        most = min(stopping["max_new_tokens"] or 20, MAX_FUZZ_NEW)
        stopping["min_new_tokens"] = rng.choice([0, 1, most - 1, most, rng.randint(0, most)])
    if rng.random() < 0.2:
        stopping["time_limit_millis"] = rng.choice(TIME_LIMIT_MILLIS)
    if rng.random() < 0.3:
        stopping["stop_sequences"] = rng.sample(STOP_SEQUENCES[0], rng.randint(1, 6))
    if rng.random() < 0.3:
        stopping["include_stop_sequence"] = rng.random() < 0.5
    params["stopping"] = stopping
    if rng.random() < 0.5:
        response: dict[str, Any] = {flag: rng.random() < 0.5 for flag in FLAGS}
        response["top_n_tokens"] = rng.choice(TOP_N_TOKENS[0])
        details = response["token_logprobs"] or response["token_ranks"] or response["top_n_tokens"]
        if details and not (response["input_tokens"] or response["generated_tokens"]):
            response[rng.choice(["input_tokens", "generated_tokens"])] = True
        params["response"] = response
    if rng.random() < 0.2:
        params["truncate_input_tokens"] = rng.choice(TRUNCATE)
    return params


def corrupt(rng: random.Random, params: dict[str, Any], kind: str) -> None:
    """Set one field of `params` to a value validation rejects (a sampling field only matters
    with SAMPLE: under GREEDY the request stays valid). "long_input" is applied by the caller."""
    stopping = params.setdefault("stopping", {})
    if kind in ("temperature", "top_k", "top_p", "typical_p"):
        pools: dict[str, Pool] = {
            "temperature": TEMPERATURE,
            "top_k": TOP_K,
            "top_p": TOP_P,
            "typical_p": TYPICAL_P,
        }
        params.setdefault("sampling", {})[kind] = rng.choice(pools[kind][1])
    elif kind == "repetition_penalty":
        params.setdefault("decoding", {})[kind] = rng.choice(REPETITION_PENALTY[1])
    elif kind == "decay_factor":
        params.setdefault("decoding", {})["length_penalty"] = {
            "start_index": rng.choice(START_INDEX),
            "decay_factor": rng.choice(DECAY_FACTOR[1]),
        }
    elif kind == "max_new_tokens":
        stopping["max_new_tokens"] = rng.choice(MAX_NEW_TOKENS[1])
    elif kind == "min_new_tokens":
        most = stopping.get("max_new_tokens") or 20
        stopping["min_new_tokens"] = rng.choice([min(most + 1, U32), SERVER_MAX_NEW, I32, U32])
        if stopping["min_new_tokens"] == SERVER_MAX_NEW:  # passes the parameter checks, but
            stopping["max_new_tokens"] = SERVER_MAX_NEW  # no prompt of ours leaves room for it
    elif kind == "stop_sequences":
        if rng.random() < 0.3:
            stopping["stop_sequences"] = rng.choices(STOP_SEQUENCES[0], k=7)
        else:
            stops = rng.sample(STOP_SEQUENCES[0], rng.randint(0, 5))
            stops.insert(rng.randint(0, len(stops)), rng.choice(STOP_SEQUENCES[1]))
            stopping["stop_sequences"] = stops
    elif kind == "top_n_tokens":
        response = params.setdefault("response", {})
        response["generated_tokens"] = True
        response["top_n_tokens"] = rng.choice(TOP_N_TOKENS[1])
    elif kind == "token_detail":
        detail = rng.choice(["token_logprobs", "token_ranks", "top_n_tokens"])
        params["response"] = {detail: 3 if detail == "top_n_tokens" else True}


def random_case(rng: random.Random, index: int) -> Case:
    params = valid_params(rng)
    hostile = rng.random() < 0.5
    long_input = False
    if hostile:
        for kind in rng.sample(CORRUPTIONS, rng.choice([1, 1, 2])):
            corrupt(rng, params, kind)
            long_input |= kind == "long_input"
        if long_input:
            params.pop("truncate_input_tokens", None)
    elif rng.random() < 0.1:
        long_input = True
        params["truncate_input_tokens"] = rng.choice([1, 8, 64])
    prompts = [*CHAT_PROMPTS, "", "Hello"]
    rpc = rng.choice(["generate", "stream"])
    if rpc == "stream":
        texts = [LONG_PROMPT if long_input else rng.choice(prompts)]
    else:
        texts = [rng.choice(prompts) for _ in range(rng.choice([0, 1, 1, 1, 1, 1, 2, 2]))]
        if long_input:
            texts.append(LONG_PROMPT)
    edge = params.get("decoding", {}).get("repetition_penalty") in EDGE_PENALTIES
    return Case(f"random {index}", rpc, texts, params, None if hostile or edge else "ok")


LP_10 = {"length_penalty": {"start_index": 0, "decay_factor": 10.0}}
EXPLICIT: list[tuple[str, dict[str, Any], str | None]] = [
    ("SAMPLE temperature NaN", {"method": "SAMPLE", "sampling": {"temperature": NAN}}, "invalid"),
    ("repetition_penalty NaN", {"decoding": {"repetition_penalty": NAN}}, "invalid"),
    (
        "SAMPLE length_penalty {0, 10} min 40",
        {
            "method": "SAMPLE",
            "sampling": {"seed": 7},
            "decoding": LP_10,
            "stopping": {"min_new_tokens": 40, "max_new_tokens": 60},
        },
        "ok",
    ),
    (
        "GREEDY length_penalty {0, 10} min 40",
        {"decoding": LP_10, "stopping": {"min_new_tokens": 40, "max_new_tokens": 60}},
        "ok",
    ),
    (
        "GREEDY length_penalty {0, 10} min 29 max 30",
        {"decoding": LP_10, "stopping": {"min_new_tokens": 29, "max_new_tokens": 30}},
        "ok",
    ),
    (
        "GREEDY length_penalty {0, 10} min 45 max 46 with logprobs",
        {
            "decoding": LP_10,
            "stopping": {"min_new_tokens": 45, "max_new_tokens": 46},
            "response": {"generated_tokens": True, "token_logprobs": True, "top_n_tokens": 3},
        },
        "ok",
    ),
    (
        "SAMPLE repetition_penalty 1e-38",
        {"method": "SAMPLE", "sampling": {"seed": 3}, "decoding": {"repetition_penalty": 1e-38}},
        None,
    ),
    ("GREEDY ignores NaN sampling", {"sampling": {"temperature": NAN, "top_p": INF}}, "ok"),
    ("max_new_tokens 2**32-1", {"stopping": {"max_new_tokens": U32}}, "invalid"),
    (
        "max_new_tokens above the max",
        {"stopping": {"max_new_tokens": SERVER_MAX_NEW + 1}},
        "invalid",
    ),
    ("max_new_tokens at the max, clamped", {"stopping": {"max_new_tokens": SERVER_MAX_NEW}}, "ok"),
    (
        "SAMPLE temperature 1e30 repetition_penalty 1e-30",
        {
            "method": "SAMPLE",
            "sampling": {"temperature": 1e30},
            "decoding": {"repetition_penalty": 1e-30},
            "response": {"generated_tokens": True, "token_logprobs": True, "token_ranks": True},
        },
        "ok",
    ),
]


def all_cases(rng: random.Random) -> list[Case]:
    cases = [
        Case(name, rpc, [rng.choice(CHAT_PROMPTS)], params, expect)
        for name, params, expect in EXPLICIT
        for rpc in ("generate", "stream")
    ]
    cases += [random_case(rng, i) for i in range(NUM_RANDOM)]
    rng.shuffle(cases)
    return cases


def run_case(server: Server, case: Case) -> Outcome:
    try:
        if case.rpc == "stream":
            request = single_request(case.texts[0], case.params)
            messages = list(server.stub.GenerateStream(request, timeout=60))
            if not messages or messages[-1].stop_reason == pb.NOT_FINISHED:
                return Outcome(grpc.StatusCode.OK, "", "the stream ended without a stop reason")
        else:
            response = server.stub.Generate(batch_request(case.texts, case.params), timeout=60)
            if len(response.responses) != len(case.texts):
                problem = f"{len(response.responses)} responses to {len(case.texts)} inputs"
                return Outcome(grpc.StatusCode.OK, "", problem)
            if any(r.stop_reason == pb.NOT_FINISHED for r in response.responses):
                return Outcome(grpc.StatusCode.OK, "", "a response without a stop reason")
    except grpc.RpcError as e:
        return Outcome(e.code(), str(e.details()))
    return Outcome(grpc.StatusCode.OK, "")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    with running_server(MODEL, ENV, log) as server:
        yield server


def test_fuzzed_parameters_harm_no_one(server: Server) -> None:
    t0 = time.monotonic()
    info = server.stub.ModelInfo(pb.ModelInfoRequest())
    assert (info.max_sequence_length, info.max_new_tokens) == (MAX_SEQ, SERVER_MAX_NEW)
    solo = [generate_texts(server, [p], INNOCENT)[0] for p in INNOCENT_PROMPTS]
    cases = all_cases(random.Random(SEED))
    done = threading.Event()

    def innocent(worker: int) -> list[tuple[int, str]]:
        """Innocent requests one after another, Generate and GenerateStream in turn, until the
        fuzz requests are done; a failed one gives its status as its text."""
        results: list[tuple[int, str]] = []
        while not (results and done.is_set()):
            i = len(results) + worker
            prompt = INNOCENT_PROMPTS[i % len(INNOCENT_PROMPTS)]
            try:
                if i % 2:
                    text = stream_text(server, prompt, INNOCENT)
                else:
                    text = generate_texts(server, [prompt], INNOCENT)[0]
            except grpc.RpcError as e:
                text = f"<{e.code().name}: {e.details()}>"
            results.append((i % len(INNOCENT_PROMPTS), text))
        return results

    with (
        ThreadPoolExecutor(INNOCENT_WORKERS) as innocent_pool,
        ThreadPoolExecutor(FUZZ_WORKERS) as fuzz_pool,
    ):
        innocents = [innocent_pool.submit(innocent, w) for w in range(INNOCENT_WORKERS)]
        futures: list[Future[Outcome]] = [fuzz_pool.submit(run_case, server, c) for c in cases]
        try:
            outcomes = [f.result(timeout=120) for f in futures]
        finally:
            done.set()
        innocent_results = [r for f in innocents for r in f.result(timeout=120)]

    failures: list[str] = []
    for i, text in innocent_results:
        if text != solo[i]:
            failures.append(f"innocent {INNOCENT_PROMPTS[i]!r}: {text!r} != solo {solo[i]!r}")
    counts = {"generate": 0, "stream": 0}
    ok = bad = 0
    for case, outcome in zip(cases, outcomes, strict=True):
        counts[case.rpc] += 1
        what = f"{case.name} ({case.rpc} {case.texts!r:.80}, params {case.params})"
        if outcome.code == grpc.StatusCode.OK:
            ok += 1
            if outcome.problem:
                failures.append(f"{what}: OK but {outcome.problem}")
            elif case.expect == "invalid":
                failures.append(f"{what}: OK, expected INVALID_ARGUMENT")
        elif outcome.code == grpc.StatusCode.INVALID_ARGUMENT:
            bad += 1
            if case.expect == "ok":
                failures.append(f"{what}: INVALID_ARGUMENT {outcome.message!r}, expected OK")
        else:
            failures.append(f"{what}: {outcome.code.name} {outcome.message!r}")

    health = server.process.health()
    if health != 200:
        failures.append(f"/health answered {health}")
    deadline = time.monotonic() + 10
    while (blocks := server.process.metric("tgi_kv_cache_blocks_used")) != 0:
        if time.monotonic() > deadline:
            failures.append(f"tgi_kv_cache_blocks_used is {blocks} after all requests ended")
            break
        time.sleep(0.05)
    log = server.process.log_text()
    if "Traceback" in log:
        failures.append(f"the server log has a traceback:\n{log[log.index('Traceback') :][:3000]}")
    print(
        f"\nfuzz seed {SEED}: {len(cases)} requests ({counts['generate']} Generate, "
        f"{counts['stream']} GenerateStream): {ok} ok, {bad} bad (INVALID_ARGUMENT), "
        f"{len(innocent_results)} innocent, {len(failures)} failures "
        f"in {time.monotonic() - t0:.1f} s"
    )
    assert not failures, "\n".join(failures)
    assert ok > len(cases) // 5 and bad > len(cases) // 5, (ok, bad)
