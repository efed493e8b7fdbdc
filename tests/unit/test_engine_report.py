"""What `LLMEngine.step()` reports (`StepStats`, `RequestEvent`s) against what the scheduler did:
its own outputs (observed, not replaced), the requests' counters, and token counts known in
advance (every prompt token is prefilled once, every output token but the last decoded once).
And the boundary: the engine thread reads nothing of the scheduler or the KV manager."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

import server.engine_worker
from engine.config import EngineConfig, SchedulerConfig
from engine.core import LLMEngine
from engine.model_runner import ModelRunner
from engine.outputs import EngineStepOutput, RequestEvent
from engine.outputs import RequestEventType as Event
from engine.paths import model_path
from engine.request import Request
from engine.sampling.params import SamplingParams
from engine.scheduler import SchedulerOutput
from engine.spec_decode.drafter import Drafter
from tests.reference import chat_prompt_ids, require_model
from tools.scripted_proposer import ScriptedProposer

MODEL = "tiny-llama-gqa-tied"
MAX_NEW = 16


@pytest.fixture(scope="module")
def path() -> Path:
    return require_model(model_path(MODEL))


def make_engine(
    path: Path, num_blocks: int, max_batched_tokens: int, prefix_caching: bool = False
) -> LLMEngine:
    runner = ModelRunner(
        EngineConfig(path, dtype="float32", block_size=16, num_kv_blocks=num_blocks)
    )
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=max_batched_tokens, max_model_len=2048
    )
    return LLMEngine(runner, config, frozenset(runner.config.eos_token_ids), None, prefix_caching)


class Recorded:
    """Every step's scheduler output (the scheduler's own, seen on its way to the engine) and
    report, and every request object, while `engine` runs `prompts` to completion."""

    def __init__(self, engine: LLMEngine, prompts: list[list[int]], params: SamplingParams):
        self.scheduled: list[SchedulerOutput] = []
        self.steps: list[EngineStepOutput] = []
        self.requests: dict[str, Request] = {}
        schedule = engine.scheduler.schedule

        def observed(now: float) -> SchedulerOutput:
            out = schedule(now)
            self.scheduled.append(out)
            return out

        engine.scheduler.schedule = observed  # type: ignore[method-assign]
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
            self.requests[str(i)] = engine.scheduler.requests[str(i)]
        while engine.has_unfinished_requests():
            step = engine.step()
            self.steps.append(step)
            stats = step.stats
            assert stats.num_running_reqs == len(engine.scheduler.running)
            assert stats.num_waiting_reqs == engine.scheduler.num_waiting
            assert stats.num_used_blocks == engine.kv.num_used_blocks
            assert stats.num_blocks == engine.kv.num_blocks
            running = engine.scheduler.running
            assert stats.num_running_tokens == sum(r.num_tokens for r in running)
        assert len(self.scheduled) == len(self.steps)

    def events(self) -> dict[str, list[RequestEvent]]:
        by_request: dict[str, list[RequestEvent]] = defaultdict(list)
        for step in self.steps:
            for event in step.events:
                by_request[event.request_id].append(event)
        return by_request


def test_stats_count_the_scheduled_tokens(path: Path) -> None:
    """Chunked prefill without preemption or prefix hits: each step's token counts are the
    scheduler's, every prompt token is a prefill token once and every output token but the
    last is a decode token once."""
    prompts = [list(p) for p in chat_prompt_ids(path)[:6]]
    engine = make_engine(path, num_blocks=256, max_batched_tokens=32)
    rec = Recorded(engine, prompts, SamplingParams(max_new_tokens=MAX_NEW))
    for sched, step in zip(rec.scheduled, rec.steps, strict=True):
        stats = step.stats
        assert stats.num_scheduled_tokens == sum(sched.num_scheduled_tokens.values())
        assert stats.num_scheduled_tokens == stats.num_prefill_tokens + stats.num_decode_tokens
        assert stats.num_scheduled_reqs == len(sched.scheduled_requests)
        assert stats.num_generated_tokens == sum(len(o.new_token_ids) for o in step.outputs)
        assert stats.num_preempted_reqs == stats.num_prefix_hit_tokens == 0
    generated = [r.num_output_tokens for r in rec.requests.values()]
    assert sum(s.stats.num_prefill_tokens for s in rec.steps) == sum(map(len, prompts))
    assert sum(s.stats.num_decode_tokens for s in rec.steps) == sum(generated) - len(prompts)
    assert sum(s.stats.num_generated_tokens for s in rec.steps) == sum(generated)
    assert any(0 < s.stats.num_prefill_tokens < s.stats.num_scheduled_tokens for s in rec.steps)
    last = rec.steps[-1].stats
    assert last.num_running_reqs == last.num_waiting_reqs == last.num_used_blocks == 0


def test_events_follow_each_request_through_preemption(path: Path) -> None:
    """A pool too small for every request: the reported preemptions and admissions are the
    scheduler's, and each request's events tell its life in order (queued, scheduled,
    [preempted, scheduled]..., first token once, finished last)."""
    prompts = [list(p) for p in chat_prompt_ids(path)[:10]]
    engine = make_engine(path, num_blocks=14, max_batched_tokens=64)
    rec = Recorded(engine, prompts, SamplingParams(max_new_tokens=24))
    for sched, step in zip(rec.scheduled, rec.steps, strict=True):
        kinds = defaultdict(list)
        for event in step.events:
            kinds[event.type].append(event.request_id)
        assert kinds[Event.PREEMPTED] == sched.preempted_req_ids
        assert step.stats.num_preempted_reqs == len(sched.preempted_req_ids)
        assert kinds[Event.SCHEDULED] == sched.admitted_req_ids
        assert step.stats.num_admitted_reqs == len(sched.admitted_req_ids)
        finished = [o.request_id for o in step.outputs if o.finished]
        assert sorted(kinds[Event.FINISHED]) == sorted(finished)
        first = [o.request_id for o in step.outputs if o.new_token_ids]
        assert set(kinds[Event.FIRST_TOKEN]) <= set(first)
    num_preempted = sum(s.stats.num_preempted_reqs for s in rec.steps)
    assert num_preempted > 0 and num_preempted == engine.scheduler.num_preemptions
    for request_id, events in rec.events().items():
        req = rec.requests[request_id]
        kinds = [e.type for e in events]
        assert kinds[0] == Event.QUEUED and kinds[1] == Event.SCHEDULED
        assert kinds[-1] == Event.FINISHED and kinds.count(Event.FINISHED) == 1
        assert kinds.count(Event.FIRST_TOKEN) == 1
        assert kinds.count(Event.PREEMPTED) == req.num_preemptions
        assert kinds.count(Event.SCHEDULED) == req.num_preemptions + 1
        for k in range(2, len(kinds)):  # a preemption is followed by its rescheduling
            if kinds[k] == Event.SCHEDULED:
                assert kinds[k - 1] == Event.PREEMPTED, kinds
            if kinds[k - 1] == Event.PREEMPTED:
                assert kinds[k] in (Event.SCHEDULED, Event.FINISHED), kinds
        times = [e.timestamp for e in events]
        assert times == sorted(times)
    assert any(r.num_preemptions for r in rec.requests.values())


def test_first_token_event_comes_with_the_first_tokens(path: Path) -> None:
    prompts = [list(p) for p in chat_prompt_ids(path)[:3]]
    engine = make_engine(path, num_blocks=128, max_batched_tokens=16)
    rec = Recorded(engine, prompts, SamplingParams(max_new_tokens=4))
    seen: set[str] = set()
    for step in rec.steps:
        firsts = {e.request_id for e in step.events if e.type == Event.FIRST_TOKEN}
        gained = {o.request_id for o in step.outputs if o.new_token_ids}
        assert firsts == gained - seen
        seen |= gained


def test_speculation_figures(path: Path) -> None:
    """Scripted drafts accepted to known lengths: the stats count the drafts each step
    verified (the trees proposed the step before) and the accepted ones the script foresaw."""
    prompts = [list(p) for p in chat_prompt_ids(path)[:3]]
    params = SamplingParams(max_new_tokens=MAX_NEW)
    plain = Recorded(make_engine(path, 256, 4096), prompts, params)
    sequences = [p + list(plain.requests[str(i)].output_token_ids) for i, p in enumerate(prompts)]
    double = ScriptedProposer(sequences, (3, 1, 0, 2), num_heads=3, n_candidates=2)
    engine = make_engine(path, 256, 4096)
    engine.drafter = Drafter(double, None, max_batch_size=16)
    spec = Recorded(engine, prompts, params)
    for i in range(len(prompts)):
        assert spec.requests[str(i)].output_token_ids == plain.requests[str(i)].output_token_ids
    stats = [s.stats for s in spec.steps]
    assert sum(s.num_accepted_tokens for s in stats) == sum(map(sum, double.expected.values()))
    assert sum(s.num_spec_reqs for s in stats) == sum(map(len, double.expected.values()))
    for before, after, sched in zip(stats, stats[1:], spec.scheduled[1:], strict=False):
        trees = sched.scheduled_draft_trees
        assert after.num_draft_tokens == sum(t.num_drafts for t in trees.values())
        assert after.num_draft_tokens == before.num_proposed_tokens  # nothing cut or dropped
        assert after.num_spec_reqs == before.num_proposed_reqs == len(trees)
    assert sum(s.num_generated_tokens for s in stats) == sum(
        r.num_output_tokens for r in spec.requests.values()
    )
    assert max(s.num_tokens_per_spec_req for s in stats) > 1


def test_engine_worker_reads_no_scheduler_or_kv_internals() -> None:
    """server/engine_worker.py imports nothing from engine.scheduler or engine.kv_cache and
    reaches no engine attribute but the public API (no `engine.scheduler`, `engine.kv`)."""
    source = Path(server.engine_worker.__file__).read_text()
    tree = ast.parse(source)
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
    assert modules, "no imports parsed"
    assert "engine.core" in modules  # the parse sees the engine imports
    for module in modules:
        assert not module.startswith(("engine.scheduler", "engine.kv_cache")), module
    internals = {"scheduler", "kv", "kv_cache_manager", "runner", "drafter", "sampler"}
    reached = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "engine"
    }
    assert "step" in reached  # the walk sees `self.engine.<attr>`
    assert not reached & internals, reached & internals
