"""Every tensor a step builds lives on the model's device, and a step reads the device once.

A second device stands in for CUDA: the model runs on `meta` under FakeTensorMode, whose device
propagation fails any op that mixes a `meta` tensor with a CPU tensor of more than one element,
as CUDA does (an `index_select` of CUDA logits with a CPU index, say). Fake tensors carry no
values, so a step runs up to its first device-to-host copy, which raises
DataDependentOutputException: everything before it kept to the device.

To count, whole steps run on `tests.pretend_device`: `meta` tensors that hold real values, with
every read of the device and every copy from unpinned host memory counted at torch's dispatcher
(see that module for what counts).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from engine.config import EngineConfig, SchedulerConfig
from engine.core import LLMEngine
from engine.host_copy import to_device
from engine.model_runner import ModelRunner
from engine.paths import model_path
from engine.request import Request
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import Choices
from engine.spec_decode.drafter import Drafter
from engine.spec_decode.mlp_speculator import MLPSpeculator
from engine.spec_decode.proposer import MLPProposer
from engine.spec_decode.tree import DraftTree
from engine.spec_decode.verifier import Verification, last_choices_on_device
from engine.step_io import SequenceInput
from tests.pretend_device import PretendDevice, counted, pretend_device
from tests.reference import random_speculator, require_model
from tools.scripted_proposer import ScriptedProposer

MODEL = "tiny-llama-gqa-tied"


@pytest.fixture
def fake_device() -> Iterator[None]:
    with FakeTensorMode(allow_non_fake_inputs=True):
        yield


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModelRunner]:
    """The model on `meta` (its weights read and dropped), run under FakeTensorMode. Steps run
    under no_grad instead of inference_mode, in which FakeTensorMode cannot create tensors."""
    execute = torch.no_grad()(ModelRunner.execute.__wrapped__)  # type: ignore[attr-defined]
    monkeypatch.setattr(ModelRunner, "execute", execute)
    path: Path = require_model(model_path(MODEL))
    runner = ModelRunner(EngineConfig(path, dtype="float16", device="meta", num_kv_blocks=32))
    with FakeTensorMode(allow_non_fake_inputs=True):
        yield runner


def test_cpu_index_on_device_logits_is_caught(fake_device: None) -> None:
    """The stand-in catches the crash it exists for."""
    logits = torch.zeros(4, 8, device="meta")
    with pytest.raises(RuntimeError, match="found at least two devices"):
        logits.index_select(0, torch.tensor([0, 2]))


def test_mixed_step_stays_on_device(runner: ModelRunner) -> None:
    """A prefill chunk after cached context, a decode row and a draft tree in one step; then
    the accepted nodes' K/V moves."""
    tree = DraftTree.from_paths([[5, 6, 7], [5, 8], [9]])
    steps = [
        SequenceInput(list(range(20, 40)), 16, [0, 1, 2], logits_indices=[3, 19]),
        SequenceInput([11], 7, [3]),
        SequenceInput(
            token_ids=[12, *tree.token_ids],
            num_computed_tokens=30,
            block_table=[4, 5, 6],
            positions=[30 + d for d in tree.depths],
            tree_mask=tree.attention_mask(),
            logits_indices=list(range(len(tree.depths))),
        ),
    ]
    out = runner.execute(steps)
    assert out.logits.device.type == "meta"
    assert out.logits.shape[0] == 2 + 1 + len(tree.depths)
    runner.copy_slots([64 + 1, 64 + 2], [64 + 3, 64 + 4])


def test_engine_step_reaches_its_host_copy_on_device(runner: ModelRunner) -> None:
    """Scheduling, inputs, the forward pass, the logits rows a step samples and the logit
    rules all keep to the device until the sampled ids are copied to the host."""
    engine = LLMEngine(runner, SchedulerConfig(max_num_seqs=4), frozenset({2}))
    engine.add_request("greedy", list(range(10, 30)), SamplingParams(max_new_tokens=4))
    engine.add_request(
        "penalised",
        list(range(40, 45)),
        SamplingParams(max_new_tokens=4, min_new_tokens=2, length_penalty=(0, 1.5)),
    )
    with pytest.raises(DataDependentOutputException):
        engine.step()


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every `tolist` and `item` from now on, by name."""
    reads: list[str] = []
    for name in ("tolist", "item"):
        method = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *args: object, _m=method, _n=name) -> object:  # type: ignore[no-untyped-def]
            reads.append(_n)
            return _m(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


def test_greedy_step_reads_the_device_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step of greedy requests with penalties, logprobs and top-n reads the device
    once (`tolist`), with no `item`; the model on CPU counts the reads."""
    path: Path = require_model(model_path(MODEL))
    runner = ModelRunner(EngineConfig(path, dtype="float32", num_kv_blocks=32))
    engine = LLMEngine(runner, SchedulerConfig(max_num_seqs=4), frozenset({2}))
    for i, p in enumerate(_MIXED_PARAMS):
        engine.add_request(str(i), list(range(10 + i, 30)), p)
    engine.step()  # the prompts
    reads = _count_reads(monkeypatch)
    outputs = engine.step().outputs
    assert len(outputs) == 4 and all(len(o.new_token_ids) == 1 for o in outputs)
    assert reads == ["tolist"]


_MIXED_PARAMS = [
    SamplingParams(max_new_tokens=8),
    SamplingParams(max_new_tokens=8, repetition_penalty=1.3),
    SamplingParams(max_new_tokens=8, logprobs=True, top_n_tokens=3),
    SamplingParams(max_new_tokens=8, min_new_tokens=4, length_penalty=(1, 1.5)),
]


def test_verify_step_reads_the_device_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that walks draft trees two drafts deep for greedy, penalised, logprob and sampled
    requests (every sampling rule, alone and combined), and also runs a new prompt to its first
    token, reads the device once: the choices at every tree node and at the prompt's last row
    come back in one `tolist`. The model on CPU counts the reads, on the path a device takes
    (a CPU itself chooses along the walks, a call per tree level: `walk.chooses_lazily`)."""
    path: Path = require_model(model_path(MODEL))
    sampled = [
        SamplingParams(max_new_tokens=8, temperature=0.8, seed=7, logprobs=True),
        SamplingParams(max_new_tokens=8, temperature=0.9, seed=8, top_k=20, top_p=0.9,
                       repetition_penalty=1.2, logprobs=True, top_n_tokens=2),
        SamplingParams(max_new_tokens=8, temperature=1.1, seed=9, top_p=0.8, typical_p=0.9,
                       min_new_tokens=3),
        SamplingParams(max_new_tokens=8, temperature=0.7, seed=10, repetition_penalty=1.3),
    ]  # fmt: skip
    prompts = {str(i): list(range(10 + i, 30)) for i in range(8)}
    params = dict(zip(prompts, [*_MIXED_PARAMS, *sampled], strict=True))

    def engine(drafter: Drafter | None) -> LLMEngine:
        runner = ModelRunner(EngineConfig(path, dtype="float32", num_kv_blocks=64))
        engine = LLMEngine(runner, SchedulerConfig(max_num_seqs=12), frozenset({2}), drafter)
        for request_id, prompt in prompts.items():
            engine.add_request(request_id, prompt, params[request_id])
        return engine

    plain = engine(None)
    outputs: dict[str, list[int]] = {request_id: [] for request_id in prompts}
    while plain.has_unfinished_requests():
        for out in plain.step().outputs:
            outputs[out.request_id] += out.new_token_ids
    sequences = [prompts[request_id] + tokens for request_id, tokens in outputs.items()]
    proposer = ScriptedProposer(sequences, accept_lengths=[2], num_heads=3, n_candidates=3)
    speculating = engine(Drafter(proposer, None, max_batch_size=12))
    monkeypatch.setattr("engine.spec_decode.walk.chooses_lazily", lambda device, row_tokens: False)
    speculating.step()  # the prompts; every request drafts a tree
    speculating.add_request("new", list(range(40, 52)), SamplingParams(max_new_tokens=8))
    reads = _count_reads(monkeypatch)
    step = {o.request_id: o for o in speculating.step().outputs}
    assert reads == ["tolist"]
    assert len(step["new"].new_token_ids) == 1
    for request_id, tokens in outputs.items():
        assert step[request_id].new_token_ids == tokens[1:4]
        assert step[request_id].num_accepted_tokens == 2


def test_the_pretend_device_counts_every_way_to_the_host() -> None:
    """The stand-in sees each kind of read and each copy from unpinned memory, lets a pinned
    copy through, and fails an operation that mixes devices, as CUDA does."""
    with pretend_device() as device:
        x = torch.arange(6.0, device="meta")

        def reads() -> None:
            x.sum().item()
            x.tolist()
            x.cpu()
            x.nonzero()
            x[x > 2]
            bool(x[1] > 0)
            torch.tensor([1, 2], device="meta")
            torch.ones(3).to("meta", non_blocking=True)
            to_device(torch.ones(3), x.device)  # from pinned memory

        counted(device, reads)
        with pytest.raises(RuntimeError, match="found at least two devices"):
            x.index_select(0, torch.tensor([0, 2]))
        with pytest.raises(TypeError, match="the host cannot read it"):
            x.numpy()
        assert (x + 1).cpu().tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert device.reads == [
        "item", "tolist", "copy to the host (aten.to.dtype_layout)", "aten.nonzero.default",
        "aten.index.Tensor", "__bool__",
    ]  # fmt: skip
    assert len(device.pageable_writes) == 2


_EVERY_KIND = [
    SamplingParams(max_new_tokens=5),
    SamplingParams(max_new_tokens=5, repetition_penalty=1.3, min_new_tokens=4),
    SamplingParams(max_new_tokens=5, logprobs=True, top_n_tokens=3),
    SamplingParams(max_new_tokens=5, temperature=0.8, seed=7, top_k=20, top_p=0.9,
                   repetition_penalty=1.2, logprobs=True, top_n_tokens=2),
    SamplingParams(max_new_tokens=5, temperature=1.1, seed=9, typical_p=0.9, min_new_tokens=3),
    SamplingParams(max_new_tokens=5, temperature=0.7, seed=10),
    SamplingParams(max_new_tokens=5, frequency_penalty=0.5, presence_penalty=0.3,
                   logit_bias={11: 2.0, 12: -1.0}),
    SamplingParams(max_new_tokens=5, temperature=0.9, seed=11, frequency_penalty=1.0),
]  # fmt: skip


class _Run(NamedTuple):
    token_ids: dict[str, list[int]]
    steps: list[tuple[int, int, list[str]]]  # per step: trees verified, reads, pageable writes
    trees: list[dict[str, DraftTree]]  # per step: the trees drafted for the next one


def _run_on_pretend_device(device: PretendDevice, path: Path, speculate: bool) -> _Run:
    """Every request of `_EVERY_KIND` to its end (one more prompt joins after the first step),
    each step counted."""
    runner = ModelRunner(EngineConfig(path, dtype="float32", device="meta", num_kv_blocks=64))
    drafter = None
    if speculate:
        weights = random_speculator(runner.config.vocab_size, emb_dim=runner.config.hidden_size)
        speculator = MLPSpeculator(weights.config, device="meta")
        for name, tensor in weights.state_dict().items():
            speculator.get_parameter(name).copy_(tensor)
        drafter = Drafter(MLPProposer(speculator, [3, 2, 2], 3), None, max_batch_size=10)
    engine = LLMEngine(runner, SchedulerConfig(max_num_seqs=10), frozenset({2}), drafter)
    for i, params in enumerate(_EVERY_KIND):
        engine.add_request(str(i), list(range(10 + i, 30)), params)
    run = _Run({str(i): [] for i in range(len(_EVERY_KIND))}, [], [])
    while engine.has_unfinished_requests():
        step = counted(device, engine.step)
        if not run.steps:
            engine.add_request("new", list(range(40, 52)), SamplingParams(max_new_tokens=4))
            run.token_ids["new"] = []
        for out in step.outputs:
            run.token_ids[out.request_id] += out.new_token_ids
        run.steps.append((step.stats.num_spec_reqs, len(device.reads), device.pageable_writes[:]))
        running = engine.scheduler.running
        run.trees.append({r.request_id: r.draft_tree for r in running if r.draft_tree})
    return run


def test_speculative_steps_read_the_device_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of greedy, penalised (repetition penalty, min_new_tokens), logprob and sampled
    requests (top-k, top-p, typical-p) with an MLP speculator's trees, a prompt joining them,
    on the pretend device: every step (the forward pass, every rule, the walks, the next
    step's drafting) reads the device once and copies nothing from unpinned memory; the same
    steps without speculation read it once too, and both give the same tokens. The trees
    drafted before the read are those drafted after it from the host's view of the step
    (`Drafter.propose`, as on a CPU).

    A new read anywhere in a step (an `.item()`, a `.tolist()`, a copy to the host, a
    `nonzero`, a branch on a device value) or a host-to-device copy that skips pinned memory
    is counted by the dispatcher, whatever code makes it: the count goes above one."""
    path: Path = require_model(model_path(MODEL))
    with pretend_device() as device:
        plain = _run_on_pretend_device(device, path, speculate=False)
        spec = _run_on_pretend_device(device, path, speculate=True)
        monkeypatch.setattr(MLPProposer, "drafts_on_device", property(lambda self: False))
        after_read = _run_on_pretend_device(device, path, speculate=True)
    assert spec.token_ids == plain.token_ids == after_read.token_ids
    assert all(reads == 1 and not pageable for _, reads, pageable in plain.steps + spec.steps)
    assert max(trees for trees, _, _ in spec.steps) == len(_EVERY_KIND) + 1
    assert spec.trees == after_read.trees
    assert max(reads for _, reads, _ in after_read.steps) == 2  # the count sees drafting's read


def test_walks_on_the_device_end_where_the_host_walks_end() -> None:
    """`last_choices_on_device` against `Verification.walk` over random trees and choices that
    follow a child often, plus single choices; the rows are those of the ends."""
    rng = random.Random(0)
    request = Request("r", [1, 2], SamplingParams(), arrival_time=0.0)
    for _ in range(50):
        walks: list[int | Verification] = []
        choices: list[int] = []
        for _ in range(rng.randint(1, 6)):
            if rng.random() < 0.3:
                walks.append(len(choices))
                choices.append(rng.randrange(8))
                continue
            paths = [[rng.randrange(8) for _ in range(rng.randint(1, 4))] for _ in range(4)]
            tree = DraftTree.from_paths(paths)
            walks.append(Verification(request, tree, 0, len(choices)))
            for node in range(tree.num_drafts + 1):
                children = [t for t in range(8) if tree.child(node, t) is not None]
                follow = children and rng.random() < 0.7
                choices.append(rng.choice(children) if follow else rng.randrange(8))
        rows = rng.sample(range(100), len(choices))
        last, last_rows = last_choices_on_device(walks, rows, torch.tensor(choices))
        host = Choices(choices, [None] * len(choices), [None] * len(choices))
        expected = []
        for walk in walks:
            if isinstance(walk, Verification):
                walk.walk(host)
                expected.append(walk.first_choice + walk.node)
            else:
                expected.append(walk)
        assert last.tolist() == expected
        assert last_rows.tolist() == [rows[i] for i in expected]
