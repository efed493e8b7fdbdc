"""CPU tests for engine/scheduler.py (vLLM tests/v1/core style): a real Scheduler and
KVCacheManager driven by a fake greedy model that reads its inputs back through the block
tables, so block-table, preemption and rollback mistakes change the generated tokens."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from engine.config import SchedulerConfig
from engine.kv_cache import KVCacheManager
from engine.request import FinishReason, Request, RequestStatus
from engine.sampling.params import SamplingParams
from engine.scheduler import RequestOutput, Scheduler, SchedulerOutput
from engine.spec_decode.tree import DraftTree

VOCAB = 50
EOS = 0


def chain(*token_ids: int) -> DraftTree:
    return DraftTree.chain(token_ids)


def next_token(history: Sequence[int]) -> int:
    """The fake model: a deterministic function of the whole token history, never EOS."""
    return 1 + hash(tuple(history)) % (VOCAB - 1)


def create_scheduler(
    num_blocks: int = 1000,
    block_size: int = 4,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 512,
    prefix_caching: bool = False,
) -> Scheduler:
    config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, prefix_caching))


def create_requests(
    num_requests: int,
    num_tokens: int = 10,
    max_new_tokens: int = 16,
    min_new_tokens: int = 0,
    eos_token_ids: frozenset[int] = frozenset({EOS}),
    deadline: float | None = None,
    start: int = 0,
    **params: object,
) -> list[Request]:
    sp = SamplingParams(
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens,
        **params,  # type: ignore[arg-type]
    )
    return [
        Request(
            request_id=str(start + i),
            prompt_token_ids=[1 + (7 * (start + i) + j) % (VOCAB - 1) for j in range(num_tokens)],
            sampling_params=sp,
            arrival_time=float(start + i),
            deadline=deadline,
            eos_token_ids=eos_token_ids,
        )
        for i in range(num_requests)
    ]


class FakeModel:
    """Greedy model over a fake K/V store (one token id per slot). Each step writes the scheduled
    tokens (known tokens, then drafts) to their slots; the prediction after position q is
    `next_token` of slots 0..q read back through the block table. Drafts are verified greedily:
    accepted while equal to the prediction, then one more (correction or bonus) token."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.store = [-1] * (kv.num_blocks * kv.block_size)

    def read(self, request_id: str, num_tokens: int) -> list[int]:
        return [self.store[s] for s in self.kv.slot_mapping(request_id, 0, num_tokens)]

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        sampled: dict[str, list[int]] = {}
        for req in out.scheduled_requests:
            rid, start = req.request_id, req.num_computed_tokens
            end = start + out.num_scheduled_tokens[rid]
            tree = out.scheduled_draft_trees.get(rid)
            drafts = [] if tree is None else list(tree.token_ids)  # chains: tree order = path
            tokens = [*req.all_token_ids, *drafts][start:end]
            assert len(tokens) == end - start
            for slot, t in zip(self.kv.slot_mapping(rid, start, end), tokens, strict=True):
                self.store[slot] = t
            if end < req.num_tokens:
                continue  # a prefill chunk
            preds = [next_token(self.read(rid, q + 1)) for q in range(req.num_tokens - 1, end)]
            ids = [preds[0]]
            for j, d in enumerate(drafts):
                if d != ids[-1]:
                    break
                ids.append(preds[j + 1])
            sampled[rid] = ids
        return sampled


def reference(req: Request, max_model_len: int = 512) -> list[int]:
    """What an unbatched greedy run of `req` generates (scheduler stop rules, no deadline)."""
    p, history, out = req.sampling_params, list(req.prompt_token_ids), []
    while True:
        t = next_token(history)
        history.append(t)
        out.append(t)
        n = len(out)
        if n >= p.min_new_tokens and (
            (t in req.eos_token_ids and not p.ignore_eos) or t in p.stop_token_ids
        ):
            return out
        if n >= p.max_new_tokens or len(history) >= max_model_len:
            return out


def step(
    sched: Scheduler, model: FakeModel, now: float = 0.0
) -> tuple[SchedulerOutput, list[RequestOutput]]:
    out = sched.schedule(now)
    results = sched.update_from_output(out, model.execute(out), now)
    sched.check_integrity()
    return out, results


def run_to_completion(sched: Scheduler, model: FakeModel, max_steps: int = 10_000) -> int:
    for n in range(max_steps):
        if not sched.has_unfinished_requests():
            return n
        step(sched, model)
    raise AssertionError("did not finish")


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4)


def test_request_status_and_views() -> None:
    (req,) = create_requests(1, num_tokens=3)
    assert not req.is_finished and req.status.finish_reason is None
    req.append_output_token_ids([5, 6])
    assert req.output_token_ids == [5, 6] and req.num_tokens == 5 and req.num_output_tokens == 2
    req.draft_tree = DraftTree.from_paths([[1, 2], [3]])
    assert req.num_tokens_with_spec == 8  # 5 known tokens and 3 tree nodes
    assert all(s.is_finished for s in RequestStatus if s > RequestStatus.PREEMPTED)
    assert RequestStatus.FINISHED_ABORTED.finish_reason == FinishReason.CANCELLED
    assert RequestStatus.FINISHED_LENGTH.finish_reason == "MAX_TOKENS"
    with pytest.raises(ValueError):
        create_requests(1, num_tokens=0)


def test_chunked_prefill_does_not_stall_running_decode() -> None:
    sched = create_scheduler(max_num_seqs=4, max_num_batched_tokens=8)
    model = FakeModel(sched.kv)
    (a,) = create_requests(1, num_tokens=3, max_new_tokens=40)
    sched.add_request(a)
    step(sched, model)  # a's prefill
    assert a.num_output_tokens == 1
    (b,) = create_requests(1, num_tokens=30, start=1)
    sched.add_request(b)
    chunks = []
    while b.num_output_tokens == 0:
        n_out = a.num_output_tokens
        out, _ = step(sched, model)
        assert out.num_scheduled_tokens["0"] == 1 and a.num_output_tokens == n_out + 1
        assert out.total_num_scheduled_tokens <= 8
        chunks.append(out.num_scheduled_tokens["1"])
    assert chunks == [7, 7, 7, 7, 2]
    run_to_completion(sched, model)
    assert list(a.output_token_ids) == reference(a)
    assert list(b.output_token_ids) == reference(b)


def test_max_num_seqs() -> None:
    sched = create_scheduler(max_num_seqs=2)
    model = FakeModel(sched.kv)
    reqs = create_requests(5, max_new_tokens=4)
    for r in reqs:
        sched.add_request(r)
    seen_running = []
    while sched.has_unfinished_requests():
        out, _ = step(sched, model)
        assert len(out.scheduled_requests) <= 2 and sched.num_running <= 2
        seen_running.append(sched.num_running)
    assert max(seen_running) == 2
    assert all(list(r.output_token_ids) == reference(r) for r in reqs)


def test_admission_waits_for_free_blocks() -> None:
    sched = create_scheduler(num_blocks=6, block_size=4)  # 24 slots
    model = FakeModel(sched.kv)
    (a,) = create_requests(1, num_tokens=12, max_new_tokens=4)  # 3 blocks, 4 at the end
    (b,) = create_requests(1, num_tokens=16, max_new_tokens=2, start=1)  # 4 blocks
    sched.add_request(a)
    sched.add_request(b)
    while not a.is_finished:
        out, _ = step(sched, model)
        assert list(out.num_scheduled_tokens) == ["0"] and sched.num_waiting == 1
        assert not out.preempted_req_ids
    out, _ = step(sched, model)
    assert list(out.num_scheduled_tokens) == ["1"] and b.status == RequestStatus.RUNNING
    run_to_completion(sched, model)
    assert list(a.output_token_ids) == reference(a) and list(b.output_token_ids) == reference(b)
    assert sched.kv.num_used_blocks == 0


def test_preempt_newest_then_recompute_matches_ample_blocks() -> None:
    def run(num_blocks: int) -> tuple[dict[str, list[int]], list[str]]:
        sched = create_scheduler(num_blocks=num_blocks, block_size=4)
        model = FakeModel(sched.kv)
        reqs = create_requests(4, num_tokens=9, max_new_tokens=20)
        for r in reqs:
            sched.add_request(r)
        preempted: list[str] = []
        while sched.has_unfinished_requests():
            out, _ = step(sched, model)
            preempted += out.preempted_req_ids
        assert sched.kv.num_used_blocks == 0
        assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
        assert sched.num_preemptions == len(preempted) == sum(r.num_preemptions for r in reqs)
        return {r.request_id: list(r.output_token_ids) for r in reqs}, preempted

    ample, none = run(1000)
    tight, preempted = run(16)  # 4 x 3 blocks of prompt fit; 4 x 8 blocks at the end do not
    assert none == [] and preempted and preempted[0] == "3"  # the newest goes first
    assert tight == ample
    assert all(
        tight[k] == reference(r) for k, r in zip("0123", create_requests(4, 9, 20), strict=True)
    )


def test_abort_waiting_running_and_in_flight() -> None:
    sched = create_scheduler(max_num_seqs=2)
    model = FakeModel(sched.kv)
    a, b, c = create_requests(3)
    for r in (a, b, c):
        sched.add_request(r)
    step(sched, model)
    assert a.status == b.status == RequestStatus.RUNNING and c.status == RequestStatus.WAITING
    sched.abort_request("0")
    sched.abort_request("2")
    sched.abort_request("nope")  # ignored
    out = sched.schedule(1.0)
    assert [r.request_id for r in out.finished_requests] == ["0", "2"]
    assert a.status == c.status == RequestStatus.FINISHED_ABORTED
    assert [r.request_id for r in out.scheduled_requests] == ["1"]
    sched.abort_request("1")  # while the step is in flight: its tokens are dropped
    n = b.num_output_tokens
    assert sched.update_from_output(out, model.execute(out), 1.0) == []
    assert b.num_output_tokens == n
    out = sched.schedule(2.0)
    assert [r.request_id for r in out.finished_requests] == ["1"] and not out.scheduled_requests
    assert sched.kv.num_used_blocks == 0 and not sched.has_unfinished_requests()
    sched.check_integrity()


def test_time_limit_in_queue_and_in_flight() -> None:
    sched = create_scheduler(max_num_seqs=1, max_num_batched_tokens=4)
    model = FakeModel(sched.kv)
    (a,) = create_requests(1, num_tokens=3, max_new_tokens=100, deadline=10.0)
    (b,) = create_requests(1, deadline=5.0, start=1)  # waits behind a (max_num_seqs 1)
    (c,) = create_requests(1, num_tokens=20, deadline=7.0, start=2)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, model, now=0.0)
    out, _ = step(sched, model, now=5.0)
    assert out.finished_requests == [b] and b.status == RequestStatus.FINISHED_TIME_LIMIT
    assert b.num_output_tokens == 0 and b.status.finish_reason == FinishReason.TIME_LIMIT
    out = sched.schedule(now=9.0)
    n = a.num_output_tokens
    (res,) = sched.update_from_output(out, model.execute(out), now=10.0)  # deadline in flight
    assert res.finished and res.status == RequestStatus.FINISHED_TIME_LIMIT
    assert len(res.new_token_ids) == 1 and a.num_output_tokens == n + 1
    sched.add_request(c)  # a 20-token prompt, 4 tokens per step: expires mid-prefill
    step(sched, model, now=6.0)
    assert c.status == RequestStatus.RUNNING and c.num_computed_tokens == 4
    out, _ = step(sched, model, now=7.0)
    assert out.finished_requests == [c] and c.num_output_tokens == 0
    assert sched.kv.num_used_blocks == 0


def test_eos_suppressed_before_min_new_tokens() -> None:
    sched = create_scheduler()
    (a,) = create_requests(1, min_new_tokens=3)
    (b,) = create_requests(1, ignore_eos=True, stop_token_ids=(7,), start=1)
    sched.add_request(a)
    sched.add_request(b)
    statuses = []
    for _ in range(3):
        out = sched.schedule(0.0)
        results = sched.update_from_output(out, {"0": [EOS], "1": [EOS]}, 0.0)
        statuses.append(results[0].status)
    assert statuses == [RequestStatus.RUNNING] * 2 + [RequestStatus.FINISHED_STOPPED]
    assert list(a.output_token_ids) == [EOS] * 3
    assert b.status == RequestStatus.RUNNING  # ignore_eos
    out = sched.schedule(0.0)
    (res,) = sched.update_from_output(out, {"1": [7]}, 0.0)
    assert res.status == RequestStatus.FINISHED_STOPPED and res.finish_reason == "EOS_TOKEN"
    assert sched.kv.num_used_blocks == 0


def test_max_model_len_trims_drafts() -> None:
    # Drafts are tree nodes at consecutive slots: only the slots must fit max_model_len (the
    # proposer bounds the depth by max_new_tokens).
    sched = create_scheduler(max_model_len=13)
    (a,) = create_requests(1, max_new_tokens=8)
    sched.add_request(a)
    out = sched.schedule(0.0)
    sched.update_from_output(out, {"0": [11]}, 0.0)
    sched.update_draft_trees({"0": chain(12, 13, 14)})
    out = sched.schedule(0.0)
    # 11 tokens are known; slots 10 (token 11), 11 and 12 fit in 13 positions.
    assert out.num_scheduled_tokens["0"] == 3 and out.scheduled_draft_trees["0"].token_ids == (
        12,
        13,
    )
    (res,) = sched.update_from_output(out, {"0": [12, 15]}, 0.0)
    assert res.new_token_ids == [12, 15] and res.status == RequestStatus.FINISHED_LENGTH
    assert list(a.output_token_ids) == [11, 12, 15] and sched.kv.num_used_blocks == 0


def test_stop_inside_accepted_drafts_drops_the_rest() -> None:
    sched = create_scheduler()
    (a,) = create_requests(1)
    sched.add_request(a)
    sched.update_from_output(sched.schedule(0.0), {"0": [11]}, 0.0)
    sched.update_draft_trees({"0": chain(12, EOS, 13)})
    out = sched.schedule(0.0)
    (res,) = sched.update_from_output(out, {"0": [12, EOS, 13, 14]}, 0.0)
    assert res.new_token_ids == [12, EOS] and res.status == RequestStatus.FINISHED_STOPPED
    assert res.num_accepted_tokens == 3 and list(a.output_token_ids) == [11, 12, EOS]
    assert sched.kv.num_used_blocks == 0


def test_spec_three_drafts_one_accepted_then_eos() -> None:
    sched = create_scheduler()
    a, b = create_requests(2, num_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule(0.0)
    sched.update_from_output(out, {"0": [20], "1": [30]}, 0.0)
    sched.update_draft_trees({"0": chain(21, 22, 23), "1": chain(31, 32, 33)})
    out = sched.schedule(0.0)
    assert out.num_scheduled_tokens == {"0": 4, "1": 4} and out.total_num_scheduled_tokens == 8
    assert out.scheduled_draft_trees == {"0": chain(21, 22, 23), "1": chain(31, 32, 33)}
    assert a.draft_tree is None
    ra, rb = sched.update_from_output(out, {"0": [21, EOS], "1": [31, 40]}, 0.0)
    assert ra.new_token_ids == [21, EOS] and ra.status == RequestStatus.FINISHED_STOPPED
    assert (ra.num_draft_tokens, ra.num_accepted_tokens) == (3, 1)
    assert rb.new_token_ids == [31, 40] and rb.status == RequestStatus.RUNNING
    assert list(b.output_token_ids) == [30, 31, 40]
    assert b.num_computed_tokens == b.num_tokens - 1 == 8  # 2 rejected drafts rolled back
    assert sched.kv.num_tokens("1") == 8 and sched.kv.num_used_blocks == 2
    sched.check_integrity()


def test_drafts_never_starve_a_running_request() -> None:
    sched = create_scheduler(max_num_seqs=2, max_num_batched_tokens=4)
    a, b = create_requests(2, num_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    sched.update_from_output(sched.schedule(0.0), {"0": [11], "1": [12]}, 0.0)
    sched.update_draft_trees({"0": chain(1, 2, 3, 4, 5)})
    out = sched.schedule(0.0)
    assert out.num_scheduled_tokens == {"0": 3, "1": 1}  # one token kept back for b
    assert (
        out.scheduled_draft_trees["0"].token_ids == (1, 2) and len(out.scheduled_draft_trees) == 1
    )


def test_rejected_drafts_roll_back_without_leak() -> None:
    sched = create_scheduler(block_size=4)
    (a,) = create_requests(1, num_tokens=5, max_new_tokens=100)
    sched.add_request(a)
    sched.update_from_output(sched.schedule(0.0), {"0": [1]}, 0.0)
    for i in range(20):
        sched.update_draft_trees({"0": chain(*[2] * 9)})  # 2-3 blocks past the tokens
        out = sched.schedule(0.0)
        assert sched.kv.num_tokens("0") == a.num_tokens + 9
        sched.update_from_output(out, {"0": [2] * (i % 3) + [3]}, 0.0)
        assert a.num_computed_tokens == a.num_tokens - 1 == sched.kv.num_tokens("0")
        assert sched.kv.num_used_blocks == -(-a.num_computed_tokens // 4)
        sched.check_integrity()


def test_prompt_larger_than_pool_is_rejected() -> None:
    sched = create_scheduler(num_blocks=4, block_size=4)  # 16 tokens in the whole pool
    (too_long,) = create_requests(1, num_tokens=16, max_new_tokens=100)
    sched.add_request(too_long)
    assert too_long.status == RequestStatus.FINISHED_IGNORED and sched.has_unfinished_requests()
    out = sched.schedule(0.0)
    assert out.finished_requests == [too_long] and too_long.status.finish_reason == "ERROR"
    assert not sched.has_unfinished_requests()
    (fits,) = create_requests(1, num_tokens=15, max_new_tokens=100, start=1)
    sched.add_request(fits)
    run_to_completion(sched, FakeModel(sched.kv))
    assert fits.status == RequestStatus.FINISHED_LENGTH and fits.num_tokens == 16
    assert list(fits.output_token_ids) == reference(fits, max_model_len=16)


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["plain", "prefix-caching"])
def test_randomized_soak(prefix_caching: bool) -> None:
    """Random arrivals, lengths, stops, deadlines, aborts, drafts and preemptions; with prefix
    caching, most prompts start with one of three shared prefixes, so blocks are shared, kept
    while free and evicted. Every output equals the unbatched reference."""
    rng = random.Random(1234)
    sched = create_scheduler(
        num_blocks=40,
        block_size=4,
        max_num_seqs=6,
        max_num_batched_tokens=24,
        prefix_caching=prefix_caching,
    )
    prefix_rng = random.Random(99)  # apart from `rng`: the plain run's draws stay as they were
    shared = [[prefix_rng.randrange(1, VOCAB) for _ in range(40)] for _ in range(3)]
    model = FakeModel(sched.kv)
    live: dict[str, Request] = {}
    done: list[Request] = []
    counts = {"preempted": 0, "drafts": 0, "accepted": 0}
    next_id = 0
    steps = 3000
    for t in range(steps + 1000):
        now = t * 0.01
        if t < steps and rng.random() < 0.3:
            n_prompt = 170 if rng.random() < 0.01 else rng.randint(1, 60)  # pool: 160 tokens
            prompt = [rng.randrange(1, VOCAB) for _ in range(n_prompt)]
            if prefix_caching and n_prompt < 170 and prefix_rng.random() < 0.7:
                prefix = prefix_rng.choice(shared)[: prefix_rng.randint(1, 40)]
                prompt = prefix + prompt[: prefix_rng.randint(1, 20)]
            req = Request(
                request_id=str(next_id),
                prompt_token_ids=prompt,
                sampling_params=SamplingParams(
                    max_new_tokens=rng.randint(1, 40),
                    min_new_tokens=rng.randint(0, 3),
                    stop_token_ids=(rng.randrange(1, VOCAB),) if rng.random() < 0.3 else (),
                ),
                arrival_time=now,
                deadline=now + rng.uniform(0.5, 5) if rng.random() < 0.2 else None,
                eos_token_ids=frozenset({rng.randrange(1, VOCAB)}),
            )
            next_id += 1
            sched.add_request(req)
            live[req.request_id] = req
        if live and rng.random() < 0.02:
            sched.abort_request(rng.choice(list(live)))
        out = sched.schedule(now)
        counts["preempted"] += len(out.preempted_req_ids)
        results = sched.update_from_output(out, model.execute(out), now)
        drafts = {}
        for res in results:
            req = live[res.request_id]
            counts["drafts"] += res.num_draft_tokens
            counts["accepted"] += res.num_accepted_tokens
            if not res.finished and rng.random() < 0.5:
                history, ds = list(req.all_token_ids), []
                for _ in range(rng.randint(1, 5)):  # a drafter that is right 70% of the time
                    d = next_token(history) if rng.random() < 0.7 else rng.randrange(1, VOCAB)
                    ds.append(d)
                    history.append(d)
                drafts[res.request_id] = ds
        sched.update_draft_trees({rid: DraftTree.chain(ds) for rid, ds in drafts.items()})
        for req in [*out.finished_requests, *(live[r.request_id] for r in results if r.finished)]:
            done.append(live.pop(req.request_id))
        sched.check_integrity()
        if t >= steps and not sched.has_unfinished_requests():
            break
    assert not live and sched.kv.num_used_blocks == 0 and sched.kv.num_free_blocks == 40
    assert counts["preempted"] > 0 and 0 < counts["accepted"] < counts["drafts"]
    assert (sched.kv.num_prefix_hit_tokens > 0) == prefix_caching
    statuses = {r.status for r in done}
    assert statuses >= {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_IGNORED,
    }
    if not prefix_caching:  # cached prefixes finish requests before this seed's deadlines
        assert RequestStatus.FINISHED_TIME_LIMIT in statuses
    for r in done:
        ref = reference(r, max_model_len=sched.max_model_len)
        if r.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            assert list(r.output_token_ids) == ref, r.request_id
        else:
            assert list(r.output_token_ids) == ref[: r.num_output_tokens], r.request_id
