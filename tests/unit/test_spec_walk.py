"""On a CPU, a verify step chooses tokens only at the draft-tree nodes its walks reach.

Oracles: the same engine choosing at every node at once (the path off a CPU, forced here with
`chooses_lazily`), and the engine run one token per step without speculation.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch

import engine.spec_decode.walk as walk
from engine.core import LLMEngine
from engine.outputs import EngineOutput
from engine.paths import model_path
from engine.request import RequestStatus
from engine.sampling.params import SamplingParams
from engine.scheduler import SchedulerOutput
from engine.step_io import ModelOutput, SequenceInput
from tests.reference import hf_greedy
from tests.unit.test_spec_decoding import MAX_NEW, TINY, Run, make_engine, run, tiny_prompts
from tools.scripted_proposer import ScriptedProposer

ACCEPT_LENGTHS = (2, 0, 3, 1, 4)


def _params(eos_token: int) -> list[SamplingParams]:
    """Greedy and seeded sampled requests under every kind of rule, mixed in one batch."""
    return [
        SamplingParams(max_new_tokens=MAX_NEW, min_new_tokens=6),
        SamplingParams(
            max_new_tokens=MAX_NEW,
            temperature=0.8,
            top_k=20,
            seed=7,
            logprobs=True,
            top_n_tokens=3,
        ),
        SamplingParams(
            max_new_tokens=MAX_NEW,
            temperature=1.2,
            top_p=0.9,
            typical_p=0.8,
            seed=3,
            logit_bias={eos_token: -5.0, 17: 3.0},
        ),
        SamplingParams(
            max_new_tokens=MAX_NEW,
            temperature=0.7,
            repetition_penalty=1.3,
            min_new_tokens=8,
            seed=2**64 - 1,
            logprobs=True,
        ),
        SamplingParams(
            max_new_tokens=MAX_NEW,
            presence_penalty=0.5,
            frequency_penalty=0.4,
            logprobs=True,
            top_n_tokens=2,
        ),
        SamplingParams(
            max_new_tokens=MAX_NEW,
            temperature=0.9,
            top_p=0.8,
            frequency_penalty=1.0,
            repetition_penalty=1.1,
            seed=0,
            logprobs=True,
            top_n_tokens=1,
        ),
    ]


def _count_rows(engine: LLMEngine) -> list[int]:
    """A running count of the rows the engine's sampler chooses tokens from."""
    count = [0]
    sampler = engine.sampler

    def counted(method: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(logits: Any, reqs: list[Any], *args: Any, **kwargs: Any) -> Any:
            count[0] += len(reqs)
            return method(logits, reqs, *args, **kwargs)

        return wrapped

    sampler.sample = counted(sampler.sample)  # type: ignore[method-assign]
    sampler.sample_on_device = counted(sampler.sample_on_device)  # type: ignore[method-assign]
    return count


def _poison(engine: LLMEngine, targets: dict[str, int]) -> None:
    """NaN logits at every draft node (the root excepted) of request r's k-th verified tree,
    for each r: k in `targets`."""
    schedule, execute = engine.scheduler.schedule, engine.runner.execute
    last: list[SchedulerOutput] = []
    seen: Counter[str] = Counter()

    def scheduled(now: float) -> SchedulerOutput:
        last[:] = [schedule(now)]
        return last[0]

    def executed(inputs: list[SequenceInput]) -> ModelOutput:
        out = execute(inputs)
        row = 0
        for req, seq in zip(last[0].scheduled_requests, inputs, strict=True):
            num_rows = 1 if seq.logits_indices is None else len(seq.logits_indices)
            if seq.tree_mask is not None:
                seen[req.request_id] += 1
                if targets.get(req.request_id) == seen[req.request_id]:
                    with torch.inference_mode():  # the runner's outputs are inference tensors
                        out.logits[row + 1 : row + num_rows] = float("nan")
            row += num_rows
        return out

    engine.scheduler.schedule = scheduled  # type: ignore[method-assign]
    engine.runner.execute = executed  # type: ignore[method-assign]


def _runs(
    monkeypatch: pytest.MonkeyPatch, poison: dict[str, int] | None = None
) -> tuple[Run, Run, Run, int, int]:
    """Plain decoding, then scripted speculation of its output, lazily and at every node, with
    the rows each speculative run chose from."""
    path = model_path(TINY)
    prompts = tiny_prompts(path, 6)
    first_tokens = hf_greedy(path, tuple(prompts[0]), 8).token_ids
    eos = frozenset({first_tokens[2]})  # comes up inside request 0's first accepted run
    params = _params(first_tokens[2])
    plain = run(make_engine(path, eos=eos), prompts, params)
    sequences = [p + plain.token_ids[str(i)] for i, p in enumerate(prompts)]
    speculative = []
    for lazy in (True, False):
        double = ScriptedProposer(sequences, ACCEPT_LENGTHS, num_heads=4, n_candidates=3)
        engine = make_engine(path, double, eos=eos)
        rows = _count_rows(engine)
        if poison:
            _poison(engine, poison)
        with monkeypatch.context() as m:
            if not lazy:
                m.setattr(walk, "chooses_lazily", lambda device, row_tokens: False)
            speculative.append((run(engine, prompts, params), rows[0]))
    (lazy_run, lazy_rows), (every_run, every_rows) = speculative
    return plain, lazy_run, every_run, lazy_rows, every_rows


def _same_outputs(a: Run, b: Run) -> None:
    for request_id, outputs in a.outputs.items():
        assert [_view(o) for o in outputs] == [_view(o) for o in b.outputs[request_id]]


def _view(o: EngineOutput) -> tuple[Any, ...]:
    return (o.new_token_ids, o.status, o.num_draft_tokens, o.num_accepted_tokens, o.logprobs,
            o.draft_depth, o.error)  # fmt: skip


def _same_tokens(plain: Run, spec: Run, request_ids: list[str]) -> None:
    for request_id in request_ids:
        assert spec.token_ids[request_id] == plain.token_ids[request_id], request_id
        assert spec.outputs[request_id][-1].status == plain.outputs[request_id][-1].status
        plain_lps = [lp for o in plain.outputs[request_id] for lp in o.logprobs or []]
        spec_lps = [lp for o in spec.outputs[request_id] for lp in o.logprobs or []]
        assert len(spec_lps) == len(plain_lps)
        for x, y in zip(plain_lps, spec_lps, strict=True):
            assert (x.token_id, x.rank, x.top_token_ids) == (y.token_id, y.rank, y.top_token_ids)
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert x.top_logprobs == pytest.approx(y.top_logprobs, abs=1e-4)


def test_lazy_walk_equals_every_node_and_plain_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    plain, lazy, every, lazy_rows, every_rows = _runs(monkeypatch)
    _same_outputs(lazy, every)
    _same_tokens(plain, lazy, list(plain.token_ids))
    for request_id in plain.token_ids:
        assert any(a >= 2 for a in lazy.accepted(request_id)), request_id
    # each row chosen gives a token kept (no stop cuts a run here): no node is chosen in vain
    num_tokens = sum(len(tokens) for tokens in lazy.token_ids.values())
    assert lazy_rows == num_tokens < every_rows / 2


def test_a_failed_node_ends_only_its_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    """NaN logits at request 0's first tree below the root, where its walk goes (2 drafts
    accepted), fail request 0 alone; at request 1's second tree, where its walk stops at the
    root (no draft accepted), they change nothing."""
    plain, lazy, every, lazy_rows, every_rows = _runs(monkeypatch, {"0": 1, "1": 2})
    _same_outputs(lazy, every)
    failed = lazy.outputs["0"][-1]
    assert failed.status == RequestStatus.FINISHED_ERROR
    assert failed.error == "the model produced non-finite logits for this request"
    assert len(lazy.outputs["0"]) == 2  # the prefill step's token, then the failed walk
    assert lazy.token_ids["0"] == plain.token_ids["0"][:1]
    _same_tokens(plain, lazy, [str(i) for i in range(1, 6)])
    assert lazy_rows < every_rows / 2
