"""Seeded sampling with speculation on and off: the same token ids, offline and through gRPC.

For each model (SmolLM2-135M-Instruct and the two tiny test models), a batch of the held-out
evaluation prompts (`eval_prompts()`, chat template, `--prompts` of them, `--max-new-tokens`
each) is sampled, request i at temperature number i mod 3 of (0.3, 0.7, 1.0) with variant number
(i div 3) mod 5 of: temperature alone, top_k 20, top_p 0.9, typical_p 0.9, and top_k 20 + top_p
0.9 + repetition_penalty 1.2 (`--per-temperature`: one batch per temperature, request i with
variant i mod 5, three times the work). Each (temperature, variant) has a fixed
seed, 1000 * (temperature index + 1) + variant index. Two batch compositions: "alone" (the
sampled requests only) and "mixed" (a greedy request on a serving prompt after every third
sampled one, `--greedy` of them, in the same batch). Float parameters are rounded to float32, as
gRPC carries them.

Offline, one engine per model (float32, no prefix caching) runs each batch without a speculator
(the reference, recording every chosen token's raw logits) and then with each speculator,
verifying its full tree every step (no adaptive policy, drafting while up to 64 requests run):
"random" (a random-weight MLP speculator, `tools.tiny_speculator`), "scripted"
(`tools.scripted_proposer` over the reference's sequences, accept lengths 4, 0, 2, 1, 3, four
heads, three candidates: its accepted drafts per step are known in advance) and "trained" (the
speculator `make speculator` writes, SmolLM2 only, when present). Through gRPC, real servers
(float32, SPECULATOR_ADAPTIVE=false) for SmolLM2 without a speculator, with the random one and
with the trained one, and for tiny-llama-gqa-tied without and with its random one, get the same
batches: "alone" as one BatchedGenerationRequest per (temperature, variant) (the params and seed
such a request shares), sent together; "mixed" as single requests sent together; the generated
tokens' pieces give the token ids.

Every output is compared with its reference (offline: the run without a speculator; gRPC: the
server without one). At the first differing position the reference's top-2 gap is rebuilt with
`tools.sampled_near_tie` from the reference's raw logits row there (offline: as recorded; gRPC:
from an offline one-token run over the reference server's prefix): below 1e-4 the difference is a
near-tie, otherwise a real mismatch. Per (model, path, speculator, temperature, composition) the
table gives requests, identical outputs, near-ties, mismatches, request-steps that verified a
draft tree, tokens per such step (accepted drafts + 1) and accepted drafts; gRPC rows take the
last three from the server's `tgi_spec_*` metrics, which count sampled requests together (one
row for the batch's temperatures). The run fails (exit 1) on any real mismatch, a speculator
without speculative steps, or scripted drafts never accepted. Writes
bench/results/spec_sampled_equality.json.

    python -m bench.spec_sampled_equality [--quick] [--models NAME ...] [--grpc-models NAME ...]
        [--no-grpc] [--temperatures 0.3 0.7 1.0] [--per-temperature] [--prompts 48]
        [--greedy 16] [--max-new-tokens 64] [--trained PATH]

`--quick`: the tiny models only, 8 prompts and 4 greedy requests.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import grpc
import torch
from transformers import PreTrainedTokenizerBase

from bench.chat_prompts import SERVING_PROMPTS
from engine.builder import build_engine, load_tokenizer
from engine.config import EngineConfig
from engine.core import LLMEngine
from engine.hooks import LogitsRecorder
from engine.paths import model_path, speculators_dir
from engine.sampling.params import SamplingParams
from engine.spec_decode.drafter import Drafter
from engine.spec_decode.loader import load_speculator
from engine.spec_decode.proposer import MLPProposer
from server.pb import generation_pb2 as pb
from server.pb import generation_pb2_grpc
from tools.sampled_near_tie import NEAR_TIE, ChoiceState, top2_gap
from tools.scripted_proposer import ScriptedProposer
from tools.server_process import ServerProcess
from tools.tiny_speculator import write_tiny_speculator
from training.prompts import chat_texts, eval_prompts

RESULTS = Path(__file__).parent / "results"
SMOLLM2 = "SmolLM2-135M-Instruct"
MODELS = (SMOLLM2, "tiny-llama-gqa-tied", "tiny-llama-mha-untied")
GRPC_MODELS = (SMOLLM2, "tiny-llama-gqa-tied")
TEMPERATURES = (0.3, 0.7, 1.0)
VARIANTS = ("plain", "top_k", "top_p", "typical_p", "mix")
ACCEPT_LENGTHS = (4, 0, 2, 1, 3)
SCRIPTED_HEADS = 4
SCRIPTED_CANDIDATES = 3
SPEC_MAX_BATCH_SIZE = 64
RANDOM_TREES = {SMOLLM2: (256, (2, 2, 1), 2)}  # inner_dim, top-k per head, candidates
TINY_RANDOM_TREE = (64, (4, 3, 2), 5)
COMPOSITIONS = ("alone", "mixed")
GREEDY = "greedy"


def f32(x: float) -> float:
    """`x` rounded to float32, as a protobuf float field carries it."""
    return float(struct.unpack("f", struct.pack("f", x))[0])


@dataclass(frozen=True)
class Req:
    """One request of a batch: its chat text (sent over gRPC), the ids the server makes of that
    text, its params, its table label (the temperature, or "greedy") and its variant."""

    request_id: str
    text: str
    prompt_ids: list[int]
    params: SamplingParams
    label: str
    variant: str


def variant_params(variant: str, temperature: float, seed: int, max_new: int) -> SamplingParams:
    base = SamplingParams(max_new_tokens=max_new, temperature=f32(temperature), seed=seed)
    if variant == "top_k":
        return replace(base, top_k=20)
    if variant == "top_p":
        return replace(base, top_p=f32(0.9))
    if variant == "typical_p":
        return replace(base, typical_p=f32(0.9))
    if variant == "mix":
        return replace(base, top_k=20, top_p=f32(0.9), repetition_penalty=f32(1.2))
    return base


Group = tuple[tuple[int, float], ...]
"""The (index, value) of the temperatures a batch's sampled requests cycle through."""


def batch_groups(args: argparse.Namespace) -> list[Group]:
    """One batch per temperature with `--per-temperature`, else one batch cycling through all."""
    temperatures = tuple(enumerate(args.temperatures))
    return [(t,) for t in temperatures] if args.per_temperature else [temperatures]


def group_name(group: Group) -> str:
    return ",".join(f"{t:g}" for _, t in group)


def make_batch(
    tokenizer: PreTrainedTokenizerBase, group: Group, composition: str, args: argparse.Namespace
) -> list[Req]:
    """The sampled requests (request i at temperature i mod the group's size, then the variants
    in turn) and, mixed, a greedy one after every third, in batch order."""
    sampled_texts = chat_texts(tokenizer, eval_prompts()[: args.prompts])
    greedy_texts = chat_texts(tokenizer, SERVING_PROMPTS[: args.greedy])
    sampled = []
    for i, text in enumerate(sampled_texts):
        k, temperature = group[i % len(group)]
        v = (i // len(group)) % len(VARIANTS)
        seed = 1000 * (k + 1) + v
        params = variant_params(VARIANTS[v], temperature, seed, args.max_new_tokens)
        ids = list(tokenizer(text)["input_ids"])
        sampled.append(Req(f"s{i}", text, ids, params, f"{temperature:g}", VARIANTS[v]))
    if composition == "alone":
        return sampled
    greedy = [
        Req(
            f"g{j}",
            text,
            list(tokenizer(text)["input_ids"]),
            SamplingParams(max_new_tokens=args.max_new_tokens),
            GREEDY,
            GREEDY,
        )
        for j, text in enumerate(greedy_texts)
    ]
    batch: list[Req] = []
    for i, req in enumerate(sampled):
        batch.append(req)
        if i % 3 == 2 and i // 3 < len(greedy):
            batch.append(greedy[i // 3])
    return batch + greedy[len(sampled) // 3 :]


@dataclass
class Run:
    """What one batch produced: per request its tokens, its speculative steps (steps that
    verified a draft tree) and the drafts each accepted, and, when recorded, each chosen token's
    raw logits row."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    spec_steps: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, list[int]] = field(default_factory=dict)
    logits: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    seconds: float = 0.0


def run_offline(
    engine: LLMEngine, drafter: Drafter | None, batch: Sequence[Req], record: bool = False
) -> Run:
    """Run `batch` to completion on `engine` with `drafter` (None: no speculation); with
    `record`, keep each chosen token's raw logits row."""
    start = time.perf_counter()
    engine.drafter = drafter
    recorder = LogitsRecorder()
    if record:
        engine.observers.append(recorder)
    result = Run()
    try:
        for req in batch:
            engine.add_request(req.request_id, req.prompt_ids, req.params)
            result.tokens[req.request_id] = []
            result.spec_steps[req.request_id] = 0
            result.accepted[req.request_id] = []
        while engine.has_unfinished_requests():
            for out in engine.step().outputs:
                if out.error is not None:
                    raise RuntimeError(f"{out.request_id}: {out.error}")
                result.tokens[out.request_id] += out.new_token_ids
                if out.draft_depth:
                    result.spec_steps[out.request_id] += 1
                    result.accepted[out.request_id].append(out.num_accepted_tokens)
    finally:
        engine.drafter = None
        if record:
            engine.observers.remove(recorder)
    if engine.kv.num_used_blocks:
        raise RuntimeError(f"{engine.kv.num_used_blocks} KV blocks still used after the batch")
    if record:
        result.logits = {r.request_id: recorder.pop(r.request_id) for r in batch}
    result.seconds = time.perf_counter() - start
    return result


def prefix_rows(engine: LLMEngine, prefixes: Sequence[list[int]]) -> list[torch.Tensor]:
    """The raw logits row of the token after each prefix: a one-token run of every prefix."""
    batch = [
        Req(f"p{i}", "", list(prefix), SamplingParams(max_new_tokens=1), GREEDY, GREEDY)
        for i, prefix in enumerate(prefixes)
    ]
    run = run_offline(engine, None, batch, record=True)
    return [run.logits[r.request_id][0] for r in batch]


@dataclass(frozen=True)
class Where:
    """What a comparison compared: a model's path ("offline" or "grpc"), speculator and batch
    composition."""

    model: str
    path: str
    speculator: str
    composition: str

    def __str__(self) -> str:
        return f"{self.model} {self.path} {self.speculator} {self.composition}"


@dataclass
class Difference:
    """A request whose output differs from the reference's, from `position` on; `gap` is the
    reference's top-2 gap there (None when one output merely ends earlier), `rebuilt` the
    argmax of the rebuilt scores (the reference's token when the rebuild is faithful)."""

    where: Where
    label: str
    request_id: str
    variant: str
    position: int
    reference_token: int | None
    other_token: int | None
    gap: float | None = None
    rebuilt: int | None = None

    @property
    def near_tie(self) -> bool:
        return self.gap is not None and self.gap < NEAR_TIE

    def __str__(self) -> str:
        return (
            f"{self.where} T={self.label} {self.request_id} ({self.variant}) at token "
            f"{self.position}: {self.reference_token} -> {self.other_token}, reference top-2 gap "
            f"{self.gap}"
        )


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


RowSource = Callable[[list[tuple[Req, int]]], list[torch.Tensor]]


def compare(
    batch: Sequence[Req],
    reference: dict[str, list[int]],
    other: dict[str, list[int]],
    rows: RowSource,
    eos_token_ids: frozenset[int],
    where: Where,
) -> list[Difference]:
    """Every request whose `other` output differs from its `reference` one, with the near-tie
    gap at the first differing position; `rows` gives the reference's raw logits rows at
    (request, position) pairs."""
    diffs: list[tuple[Req, Difference]] = []
    for req in batch:
        ref, out = reference[req.request_id], other[req.request_id]
        d = first_difference(ref, out)
        if d is None:
            continue
        diff = Difference(
            where,
            label=req.label,
            request_id=req.request_id,
            variant=req.variant,
            position=d,
            reference_token=ref[d] if d < len(ref) else None,
            other_token=out[d] if d < len(out) else None,
        )
        diffs.append((req, diff))
    tied = [
        (req, diff)
        for req, diff in diffs
        if diff.reference_token is not None and diff.other_token is not None
    ]
    for (req, diff), row in zip(
        tied, rows([(req, diff.position) for req, diff in tied]), strict=True
    ):
        ref = reference[req.request_id]
        state = ChoiceState(
            params=req.params,
            seed=req.params.seed,
            position=len(req.prompt_ids) + diff.position,
            past_token_ids=req.prompt_ids + ref[: diff.position],
            num_generated=diff.position,
            eos_token_ids=eos_token_ids,
        )
        gap = top2_gap(row, state)
        diff.gap, diff.rebuilt = gap.gap, gap.token
    return [diff for _, diff in diffs]


@dataclass
class Row:
    """One line of the table: the outcome of one label's requests in one comparison, with
    their speculative request-steps and accepted drafts; `as_scripted` (scripted only): the
    requests whose accepted drafts per step were exactly the scripted ones."""

    where: Where
    label: str
    requests: int = 0
    identical: int = 0
    near_ties: int = 0
    mismatches: int = 0
    spec_steps: int = 0
    accepted: int = 0
    as_scripted: int | None = None

    @property
    def tokens_per_step(self) -> float:
        """Tokens per speculative step: its accepted drafts plus its own token (as the server's
        `tgi_spec_tokens_per_step`)."""
        return 1 + self.accepted / self.spec_steps if self.spec_steps else float("nan")


def make_rows(
    where: Where,
    batch: Sequence[Req],
    diffs: Sequence[Difference],
    spec: dict[str, tuple[int, int]],
    label_of: Callable[[Req], str] = lambda req: req.label,
) -> list[Row]:
    """One row per label (`label_of`) of `batch`'s requests; `spec` maps a label to its
    (speculative request-steps, accepted drafts)."""
    rows: dict[str, Row] = {}
    by_request = {d.request_id: d for d in diffs}
    for req in batch:
        label = label_of(req)
        row = rows.setdefault(label, Row(where, label))
        row.requests += 1
        diff = by_request.get(req.request_id)
        if diff is None:
            row.identical += 1
        elif diff.near_tie:
            row.near_ties += 1
        else:
            row.mismatches += 1
    for label, row in rows.items():
        row.spec_steps, row.accepted = spec.get(label, (0, 0))
    return list(rows.values())


def offline_spec_stats(batch: Sequence[Req], run: Run) -> dict[str, tuple[int, int]]:
    stats: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for req in batch:
        s = stats[req.label]
        s[0] += run.spec_steps[req.request_id]
        s[1] += sum(run.accepted[req.request_id])
    return {label: (s[0], s[1]) for label, s in stats.items()}


class Speculators:
    """A model's speculators: name -> a factory of a fresh Drafter given the reference run."""

    def __init__(self, engine: LLMEngine, name: str, folder: Path, trained: Path | None) -> None:
        self.engine = engine
        inner_dim, top_k, n_candidates = RANDOM_TREES.get(name, TINY_RANDOM_TREE)
        self.random_path = write_tiny_speculator(
            folder / f"random-{name}",
            model_path(name),
            n_predict=len(top_k),
            inner_dim=inner_dim,
            top_k_tokens_per_head=top_k,
            n_candidates=n_candidates,
        )
        self.trained_path = trained
        self._mlp = {"random": self._load(self.random_path)}
        if trained is not None:
            self._mlp["trained"] = self._load(trained)
        self.names = ["random", "scripted", *(["trained"] if trained is not None else [])]
        self.scripted: ScriptedProposer | None = None

    def _load(self, path: Path) -> MLPProposer:
        config = self.engine.runner.config
        speculator = load_speculator(
            path,
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            dtype=self.engine.runner.dtype,
            device=self.engine.runner.device,
        )
        return MLPProposer(speculator)

    def drafter(self, name: str, batch: Sequence[Req], reference: Run) -> Drafter:
        if name == "scripted":
            self.scripted = ScriptedProposer(
                [r.prompt_ids + reference.tokens[r.request_id] for r in batch],
                ACCEPT_LENGTHS,
                num_heads=SCRIPTED_HEADS,
                n_candidates=SCRIPTED_CANDIDATES,
                vocab_size=self.engine.runner.config.vocab_size,
            )
            return Drafter(self.scripted, None, SPEC_MAX_BATCH_SIZE)
        return Drafter(self._mlp[name], None, SPEC_MAX_BATCH_SIZE)


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class Outcome:
    rows: list[Row] = field(default_factory=list)
    differences: list[Difference] = field(default_factory=list)
    server_vs_offline: list[dict[str, object]] = field(default_factory=list)


def offline_model(
    name: str,
    engine: LLMEngine,
    speculators: Speculators,
    tokenizer: PreTrainedTokenizerBase,
    args: argparse.Namespace,
    outcome: Outcome,
) -> dict[tuple[int, str], dict[str, list[int]]]:
    """The offline comparisons of one model; returns the reference tokens per (batch group,
    composition)."""
    references: dict[tuple[int, str], dict[str, list[int]]] = {}
    for g, group in enumerate(batch_groups(args)):
        for composition in COMPOSITIONS:
            batch = make_batch(tokenizer, group, composition, args)
            reference = run_offline(engine, None, batch, record=True)
            references[(g, composition)] = reference.tokens
            progress(
                f"{name} offline T={group_name(group)} {composition}: reference "
                f"{reference.seconds:.1f} s"
            )

            def recorded(items: list[tuple[Req, int]], ref: Run = reference) -> list[torch.Tensor]:
                return [ref.logits[req.request_id][position] for req, position in items]

            for spec_name in speculators.names:
                drafter = speculators.drafter(spec_name, batch, reference)
                run = run_offline(engine, drafter, batch)
                where = Where(name, "offline", spec_name, composition)
                diffs = compare(
                    batch, reference.tokens, run.tokens, recorded, engine.eos_token_ids, where
                )
                rows = make_rows(where, batch, diffs, offline_spec_stats(batch, run))
                if spec_name == "scripted":
                    assert speculators.scripted is not None
                    expected = speculators.scripted.expected
                    for row in rows:
                        row.as_scripted = sum(
                            run.accepted[r.request_id] == expected.get(r.request_id, [])
                            for r in batch
                            if r.label == row.label
                        )
                outcome.rows += rows
                outcome.differences += diffs
                progress(
                    f"{name} offline T={group_name(group)} {composition} {spec_name}: "
                    f"{run.seconds:.1f} s, {len(diffs)} differing"
                )
            reference.logits.clear()
    return references


@dataclass
class Served:
    tokens: dict[str, list[int]]
    spec: dict[str, tuple[int, int]]  # method -> speculative request-steps, accepted drafts


def pb_params(p: SamplingParams) -> pb.Parameters:
    params = pb.Parameters(
        method=pb.GREEDY if p.greedy else pb.SAMPLE,
        stopping=pb.StoppingCriteria(max_new_tokens=p.max_new_tokens),
        response=pb.ResponseOptions(generated_tokens=True),
    )
    if not p.greedy:
        params.sampling.CopyFrom(
            pb.SamplingParameters(
                temperature=p.temperature,
                top_k=p.top_k,
                top_p=p.top_p,
                typical_p=p.typical_p,
                seed=p.seed,
            )
        )
    if p.repetition_penalty != 1.0:
        params.decoding.repetition_penalty = p.repetition_penalty
    return params


def spec_metrics(server: ServerProcess) -> dict[str, tuple[float, float]]:
    """method -> (speculative request-steps, accepted drafts) so far."""
    return {
        method: (
            server.metric(f'tgi_spec_steps_total{{method="{method}"}}', 0.0),
            server.metric(f'tgi_spec_accepted_tokens_total{{method="{method}"}}', 0.0),
        )
        for method in ("sample", "greedy")
    }


def serve_batch(
    server: ServerProcess,
    stub: generation_pb2_grpc.GenerationServiceStub,
    tokenizer: PreTrainedTokenizerBase,
    batch: Sequence[Req],
    composition: str,
) -> Served:
    """Send `batch` ("alone": one BatchedGenerationRequest per params; "mixed": one request
    each), all at once, and collect the generated token ids."""
    if composition == "alone":
        groups: dict[SamplingParams, list[Req]] = defaultdict(list)
        for req in batch:
            groups[req.params].append(req)
        calls = list(groups.values())
    else:
        calls = [[req] for req in batch]

    def send(reqs: list[Req]) -> list[list[int]]:
        request = pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=r.text) for r in reqs],
            params=pb_params(reqs[0].params),
        )
        responses = stub.Generate(request, timeout=3600).responses
        out: list[list[int]] = []
        for response in responses:
            pieces = [t.text for t in response.tokens]
            if len(pieces) != response.generated_token_count:
                raise RuntimeError("the server returned fewer token pieces than tokens")
            ids = tokenizer.convert_tokens_to_ids(pieces)
            assert isinstance(ids, list)
            out.append([int(i) for i in ids])
        return out

    before = spec_metrics(server)
    with ThreadPoolExecutor(len(calls)) as pool:
        results = list(pool.map(send, calls))
    after = spec_metrics(server)
    tokens = {
        req.request_id: ids
        for reqs, outs in zip(calls, results, strict=True)
        for req, ids in zip(reqs, outs, strict=True)
    }
    spec: dict[str, tuple[int, int]] = {}
    for method in ("sample", "greedy"):
        steps = round(after[method][0] - before[method][0])
        accepted = round(after[method][1] - before[method][1])
        spec[method] = (steps, accepted)
    return Served(tokens, spec)


@contextmanager
def server_for(
    name: str, speculator: Path | None, label: str, args: argparse.Namespace
) -> Iterator[ServerProcess]:
    env = {
        "DTYPE_STR": "float32",
        "MAX_BATCH_SIZE": str(max(SPEC_MAX_BATCH_SIZE, args.prompts + args.greedy)),
        "MAX_SEQUENCE_LENGTH": "2048",
        "KV_CACHE_MEMORY_MB": "1024",
        "SPECULATOR_ADAPTIVE": "false",
        "SPECULATOR_MAX_BATCH_SIZE": str(SPEC_MAX_BATCH_SIZE),
    }
    unset: tuple[str, ...] = ("SPECULATOR_PATH", "SPECULATOR_NAME")
    if speculator is not None:
        env["SPECULATOR_PATH"] = str(speculator.resolve())
        unset = ()
    log = Path(tempfile.gettempdir()) / f"specserve-spec-sampled-{os.getpid()}-{name}-{label}.log"
    with ServerProcess(model_path(name), env, log, unset=unset) as server:
        yield server


def grpc_model(
    name: str,
    engine: LLMEngine,
    speculators: Speculators,
    tokenizer: PreTrainedTokenizerBase,
    offline_refs: dict[tuple[int, str], dict[str, list[int]]],
    args: argparse.Namespace,
    outcome: Outcome,
) -> None:
    """The gRPC comparisons of one model: each server gets every batch in the same order."""
    servers: dict[str, Path | None] = {"none": None, "random": speculators.random_path}
    if speculators.trained_path is not None:
        servers["trained"] = speculators.trained_path
    groups = batch_groups(args)
    batches = {
        (g, c): make_batch(tokenizer, group, c, args)
        for g, group in enumerate(groups)
        for c in COMPOSITIONS
    }
    served: dict[str, dict[tuple[int, str], Served]] = {}
    for label, speculator in servers.items():
        start = time.perf_counter()
        with (
            server_for(name, speculator, label, args) as server,
            grpc.insecure_channel(server.grpc_target) as channel,
        ):
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            served[label] = {
                key: serve_batch(server, stub, tokenizer, batch, key[1])
                for key, batch in batches.items()
            }
        progress(f"{name} gRPC server {label}: {time.perf_counter() - start:.1f} s")

    def teacher_forced(key: tuple[int, str]) -> RowSource:
        ref = served["none"][key].tokens
        return lambda items: prefix_rows(
            engine, [r.prompt_ids + ref[r.request_id][:p] for r, p in items]
        )

    for key, batch in batches.items():
        g, composition = key
        sampled_label = group_name(groups[g])

        def label_of(req: Req, sampled: str = sampled_label) -> str:
            return GREEDY if req.params.greedy else sampled

        reference = served["none"][key].tokens
        same = sum(reference[r.request_id] == offline_refs[key][r.request_id] for r in batch)
        outcome.server_vs_offline.append(
            {
                "model": name,
                "temperatures": sampled_label,
                "composition": composition,
                "requests": len(batch),
                "identical": same,
            }
        )
        for label in servers:
            if label == "none":
                continue
            where = Where(name, "grpc", label, composition)
            diffs = compare(
                batch,
                reference,
                served[label][key].tokens,
                teacher_forced(key),
                engine.eos_token_ids,
                where,
            )
            spec = served[label][key].spec
            by_label = {sampled_label: spec["sample"], GREEDY: spec["greedy"]}
            outcome.rows += make_rows(where, batch, diffs, by_label, label_of)
            outcome.differences += diffs


def print_table(rows: Sequence[Row]) -> None:
    header = (
        f"{'model':<22} {'path':<7} {'speculator':<9} {'temp':>9} {'batch':<5} {'reqs':>4} "
        f"{'same':>4} {'ties':>4} {'miss':>4} {'spec steps':>10} {'tok/step':>8} "
        f"{'accepted':>8} {'as scripted':>11}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        scripted = "" if r.as_scripted is None else f"{r.as_scripted}/{r.requests}"
        w = r.where
        print(
            f"{w.model:<22} {w.path:<7} {w.speculator:<9} {r.label:>9} {w.composition:<5} "
            f"{r.requests:>4} {r.identical:>4} {r.near_ties:>4} {r.mismatches:>4} "
            f"{r.spec_steps:>10} {r.tokens_per_step:>8.3f} {r.accepted:>8} {scripted:>11}"
        )


def failures(outcome: Outcome) -> list[str]:
    """Real mismatches, offline rebuilds that disagree with the reference's choice, speculators
    that never speculated and scripted drafts never accepted."""
    problems = [f"mismatch: {d}" for d in outcome.differences if not d.near_tie]
    problems += [
        f"the rebuilt scores choose {d.rebuilt}: {d}"
        for d in outcome.differences
        if d.where.path == "offline" and d.rebuilt is not None and d.rebuilt != d.reference_token
    ]
    runs: dict[tuple[str, str, str], list[Row]] = defaultdict(list)
    for r in outcome.rows:
        runs[(r.where.model, r.where.path, r.where.speculator)].append(r)
    for (model, path, speculator), rows in runs.items():
        if sum(r.spec_steps for r in rows) == 0:
            problems.append(f"{model} {path} {speculator}: no speculative steps")
        if speculator == "scripted" and sum(r.accepted for r in rows) == 0:
            problems.append(f"{model} {path} scripted: no draft accepted")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=None, help=f"default: {list(MODELS)}")
    parser.add_argument("--grpc-models", nargs="+", default=None, help=f"default: {GRPC_MODELS}")
    parser.add_argument("--no-grpc", action="store_true", help="offline comparisons only")
    parser.add_argument("--temperatures", nargs="+", type=float, default=list(TEMPERATURES))
    parser.add_argument(
        "--per-temperature",
        action="store_true",
        help="one batch of --prompts requests per temperature (3x the work) instead of one "
        "batch whose requests cycle through the temperatures",
    )
    parser.add_argument("--prompts", type=int, default=None, help="sampled requests (48)")
    parser.add_argument("--greedy", type=int, default=None, help="greedy requests, mixed (16)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--trained",
        type=Path,
        default=speculators_dir() / f"{SMOLLM2}-accelerator",
        help="SmolLM2's trained speculator (skipped when absent)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny models, 8 prompts, 4 greedy")
    parser.add_argument("--out", type=Path, default=RESULTS / "spec_sampled_equality.json")
    args = parser.parse_args(argv)
    if args.models is None:
        args.models = list(MODELS[1:] if args.quick else MODELS)
    if args.grpc_models is None:
        args.grpc_models = [] if args.no_grpc else [m for m in GRPC_MODELS if m in args.models]
    args.prompts = args.prompts or (8 if args.quick else 48)
    args.greedy = args.greedy if args.greedy is not None else (4 if args.quick else 16)
    if not 1 <= args.prompts <= len(eval_prompts()) or args.greedy > len(SERVING_PROMPTS):
        parser.error(f"--prompts must be 1..{len(eval_prompts())}, --greedy at most 40")
    trained = args.trained if (args.trained / "config.json").is_file() else None
    if SMOLLM2 in args.models and trained is None:
        progress(f"no trained speculator at {args.trained}: SmolLM2 runs without it")

    start = time.perf_counter()
    outcome = Outcome()
    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory(prefix="spec-sampled-") as tmp:
        for name in args.models:
            path = model_path(name)
            tokenizer = load_tokenizer(path)
            config = EngineConfig(
                path,
                dtype="float32",
                max_num_seqs=max(SPEC_MAX_BATCH_SIZE, args.prompts + args.greedy),
                max_num_batched_tokens=4096,
                kv_cache_tokens=16384,
                enable_prefix_caching=False,
            )
            engine = build_engine(config, tokenizer)
            speculators = Speculators(engine, name, Path(tmp), trained if name == SMOLLM2 else None)
            refs = offline_model(name, engine, speculators, tokenizer, args, outcome)
            if name in args.grpc_models:
                grpc_model(name, engine, speculators, tokenizer, refs, args, outcome)
            del engine, speculators
    seconds = time.perf_counter() - start

    print_table(outcome.rows)
    for d in outcome.differences:
        print(f"{'near-tie' if d.near_tie else 'MISMATCH'}: {d}")
    for s in outcome.server_vs_offline:
        print(
            f"server without speculator vs offline reference, {s['model']} "
            f"T={s['temperatures']} {s['composition']}: {s['identical']}/{s['requests']} identical"
        )
    problems = failures(outcome)
    print(f"wall time {seconds:.0f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "config": {
            "models": args.models,
            "grpc_models": args.grpc_models,
            "temperatures": args.temperatures,
            "per_temperature": args.per_temperature,
            "variants": list(VARIANTS),
            "prompts": args.prompts,
            "greedy": args.greedy,
            "max_new_tokens": args.max_new_tokens,
            "near_tie": NEAR_TIE,
            "scripted": {
                "accept_lengths": list(ACCEPT_LENGTHS),
                "num_heads": SCRIPTED_HEADS,
                "n_candidates": SCRIPTED_CANDIDATES,
            },
            "trained": str(trained) if trained is not None else None,
        },
        "rows": [
            {**asdict(r), "tokens_per_step": r.tokens_per_step if r.spec_steps else None}
            for r in outcome.rows
        ],
        "differences": [{**asdict(d), "near_tie": d.near_tie} for d in outcome.differences],
        "server_vs_offline_reference": outcome.server_vs_offline,
        "problems": problems,
        "seconds": seconds,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    for problem in problems:
        print(f"FAIL: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
