"""The speculation policy: its statistics against hand-computed values, its choice against the
throughput formula, and in the engine: speculation that does not pay is switched off, without
changing any token."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from engine.core import LLMEngine
from engine.paths import model_path
from engine.sampling.params import SamplingParams
from engine.spec_decode.drafter import Drafter, DraftingView
from engine.spec_decode.loader import load_speculator
from engine.spec_decode.policy import Method, SpeculationPolicy
from engine.spec_decode.proposer import MLPProposer, ProposalInput, Proposer
from engine.spec_decode.tree import DraftTree
from engine.step_io import ModelOutput, SequenceInput
from tests.reference import chat_prompt_ids, compare_greedy, hf_greedy
from tests.unit.test_spec_decoding import make_engine, run
from tools.scripted_proposer import ScriptedProposer
from tools.tiny_speculator import write_tiny_speculator

TREE = DraftTree.from_paths([[1, 2, 3], [1, 2, 4], [5, 6, 7]])  # leaves 3, 4, 7


def choose(policy: SpeculationPolicy, num_plain_rows: int, num_greedy: int) -> int:
    """The policy's choice for `num_greedy` greedy requests."""
    return policy.choose(num_plain_rows, {Method.GREEDY: num_greedy}).get(Method.GREEDY, 0)


def test_tree_statistics_per_candidate_count() -> None:
    policy = SpeculationPolicy(num_candidates=3, alpha=1.0)
    greedy = policy.acceptance[Method.GREEDY]
    policy.observe_tree(
        TREE, [1, 2, 4, 8], Method.GREEDY
    )  # candidate 1 matches 3 drafts, candidate 0 two
    assert [greedy.tokens[k].value for k in (1, 2, 3)] == [3, 4, 4]
    assert [greedy.rows[k].value for k in (1, 2, 3)] == [4, 5, 8]
    policy.observe_tree(TREE.first_candidates(1), [9], Method.GREEDY)
    assert greedy.tokens[1].value == 1 and greedy.tokens[2].value == 4


def test_interpolates_measured_step_times() -> None:
    policy = SpeculationPolicy(num_candidates=1)
    policy.observe_step(2, 0.010)
    policy.observe_step(10, 0.030)
    assert policy.predict_seconds(2) == pytest.approx(0.010)
    assert policy.predict_seconds(6) == pytest.approx(0.020)
    assert policy.predict_seconds(1) == pytest.approx(0.010)
    assert policy.predict_seconds(14) == pytest.approx(0.040)  # along the last two
    assert policy.predict_seconds(4, num_trees=1) is None  # no speculative step yet
    policy.observe_step(6, 0.030, num_trees=1)  # 10 ms over a plain 6-row step
    policy.observe_step(10, 0.060, num_trees=1)  # 30 ms over
    assert policy.predict_seconds(8, num_trees=1) == pytest.approx(0.025 + 0.020)
    assert policy.predict_seconds(2, num_trees=1) == pytest.approx(0.010 + 0.010)  # level
    assert policy.predict_seconds(14, num_trees=1) == pytest.approx(0.040 + 0.030)  # level
    policy.observe_step(10, 0.090, num_trees=4)  # 60 ms over
    # Between 1 and 4 trees: the excess in proportion (1 tree: 30 ms over; 4 trees: 60 ms over).
    assert policy.predict_seconds(10, num_trees=3) == pytest.approx(0.030 + 0.050)
    assert policy.predict_seconds(10, num_trees=2) == pytest.approx(0.030 + 0.040)
    assert policy.predict_seconds(6, num_trees=2) == pytest.approx(0.020 + 0.020 / 3 + 0.060 / 3)
    assert policy.predict_seconds(10, num_trees=8) == pytest.approx(0.090)  # level: 4 trees


def test_a_step_time_is_the_fastest_of_the_recent_ones() -> None:
    policy = SpeculationPolicy(num_candidates=1, window=3)
    for seconds in (0.010, 0.050, 0.012):
        policy.observe_step(1, seconds)
    assert policy.predict_seconds(1) == pytest.approx(0.010)  # a slow step does not count
    for seconds in (0.014, 0.016):
        policy.observe_step(1, seconds)
    assert policy.predict_seconds(1) == pytest.approx(0.012)  # 10 ms is no longer recent


def test_chooses_the_best_expected_rate() -> None:
    policy = SpeculationPolicy(num_candidates=3, refresh_every=1000, alpha=1.0, min_samples=1)
    assert choose(policy, num_plain_rows=0, num_greedy=2) == 0  # times a plain step first
    policy.observe_step(2, 0.010)
    policy.observe_step(16, 0.024)  # plain: 10 ms + 1 ms a row over 2
    assert choose(policy, 0, 2) == 3 and policy.probing  # no tree verified yet: a probe
    policy.observe_tree(TREE, [1, 2, 4, 8], Method.GREEDY)  # T = 3, 4, 4; S = 4, 5, 8
    for rows, seconds in [(8, 0.020), (10, 0.060), (16, 0.100)]:
        policy.observe_step(rows, seconds, num_trees=2)
    # Two requests: k=0 -> 2 tokens / 10 ms; k=1 -> 6 / 20 ms; k=2 -> 8 / 60 ms; k=3 -> 8 / 100.
    assert choose(policy, 0, 2) == 1 and not policy.probing
    policy = SpeculationPolicy(num_candidates=3, refresh_every=1000, alpha=1.0, min_samples=1)
    policy.observe_step(2, 0.010)
    policy.observe_step(16, 0.024)
    policy.observe_tree(TREE, [1, 2, 4, 8], Method.GREEDY)
    for rows, seconds in [(8, 0.100), (10, 0.110), (16, 0.120)]:  # drafting is dear
        policy.observe_step(rows, seconds, num_trees=2)
    assert choose(policy, 0, 2) == 0  # 2 tokens / 10 ms beats 6 / 100 ms
    assert choose(policy, 0, 0) == 0


def test_a_step_of_more_trees_is_priced_by_its_own_measurements() -> None:
    """One request's 4-row tree says little about four requests' 4-row trees (four draftings,
    four trees' bookkeeping): once a step of four trees is timed, four are priced by it."""
    policy = SpeculationPolicy(num_candidates=1, refresh_every=1000, alpha=1.0, min_samples=1)
    tree = DraftTree.from_paths([[1, 2, 3]])
    policy.observe_tree(tree, [1, 9], Method.GREEDY)  # T_1 = 2, S_1 = 4
    for rows, seconds in [(1, 0.020), (4, 0.022), (16, 0.030)]:
        policy.observe_step(rows, seconds)
    policy.observe_step(4, 0.030, num_trees=1)  # 8 ms over plain
    assert choose(policy, 0, 1) == 1  # 2 tokens / 30 ms beats 1 / 20 ms
    assert choose(policy, 0, 4) == 1  # priced from one tree: 8 tokens / 38 ms beat 4 / 22 ms
    policy.observe_step(16, 0.080, num_trees=4)
    assert choose(policy, 0, 4) == 0  # 8 tokens / 80 ms lose
    assert choose(policy, 0, 1) == 1


def test_speculates_only_against_a_current_plain_time() -> None:
    """Speculation waits for `min_samples` plain steps of the rows it must beat; after
    `2 * refresh_every` decisions without one, a step decodes plainly to time it again, and
    after every `refresh_every` speculative steps one request verifies the full tree (no budget
    holding it back)."""
    policy = SpeculationPolicy(
        num_candidates=3, refresh_every=2, refresh_budget=float("inf"), alpha=1.0, min_samples=2
    )
    policy.observe_tree(TREE, [1, 2, 4, 8], Method.GREEDY)  # T = 3, 4, 4; S = 4, 5, 8
    for rows, seconds in [(4, 0.011), (5, 0.5), (8, 0.9)]:
        policy.observe_step(rows, seconds, num_trees=1)
    choices, refreshes = [], []
    for _ in range(10):
        choices.append(choose(policy, 0, 1))
        refreshes.append(Method.GREEDY in policy.refreshing)
        if choices[-1] == 0:
            policy.observe_step(1, 0.010)
    assert choices == [0, 0, 1, 1, 1, 1, 0, 1, 1, 1]
    assert [i for i, r in enumerate(refreshes) if r] == [4, 8]


def test_refreshes_cost_at_most_their_budget() -> None:
    """A full tree comes once the steps since the last one took what it adds to a step divided
    by `refresh_budget`, and at least `refresh_every` decisions after it."""

    def refreshes(budget: float, num_decisions: int) -> list[int]:
        """The decisions that refreshed, each step observed as taking what the choice predicts,
        with a 10 ms plain step after every tenth to keep the plain time current."""
        policy = SpeculationPolicy(
            num_candidates=3, refresh_every=8, refresh_budget=budget, alpha=1.0, min_samples=1
        )
        policy.observe_tree(TREE, [1, 2, 4, 8], Method.GREEDY)  # T = 3, 4, 4; S = 4, 5, 8
        policy.observe_step(1, 0.010)
        for rows, seconds in [(4, 0.011), (5, 0.5), (8, 0.031)]:
            policy.observe_step(rows, seconds, num_trees=1)
        done = []
        for i in range(num_decisions):
            assert choose(policy, 0, 1) == 1  # 3 tokens in 11 ms
            full = Method.GREEDY in policy.refreshing
            done += [i] if full else []
            policy.observe_step(8 if full else 4, 0.031 if full else 0.011, num_trees=1)
            if i % 10 == 9:
                policy.observe_step(1, 0.010)
        return done

    # The full tree adds 8 - 4 rows to the chosen step, 31 - 11 = 20 ms, so 200 ms of steps
    # pass between full trees: its own 31 ms, then 11 ms steps and a 10 ms plain step in ten.
    done = refreshes(0.1, 80)
    assert len(done) >= 3
    assert all(15 <= b - a <= 17 for a, b in itertools.pairwise(done)), done
    # without a budget: every refresh_every decisions after the last full tree
    done = refreshes(float("inf"), 40)
    assert len(done) >= 3
    assert all(b - a == 9 for a, b in itertools.pairwise(done)), done


def test_explores_again_after_many_plain_decisions() -> None:
    """A tree that looked too dear once is verified again after `explore_every` plain decisions,
    then after twice as many each time the try changes nothing (up to `max_explore_every`), and
    the policy switches to it when the new measurements show it pays; its own choice to
    speculate brings the wait back to `explore_every`."""
    policy = SpeculationPolicy(
        num_candidates=3,
        refresh_every=1000,
        alpha=1.0,
        explore_every=5,
        max_explore_every=20,
        min_samples=1,
    )
    policy.observe_tree(TREE, [1, 2, 4, 8], Method.GREEDY)  # T = 3, 4, 4; S = 4, 5, 8
    policy.observe_step(2, 0.010)
    policy.observe_step(16, 0.024)  # plain: 10 ms + 1 ms a row over 2
    policy.observe_step(8, 0.500, num_trees=1)  # a cold first speculative step
    choices = []
    for _ in range(5 + 1 + 10 + 1 + 20 + 1 + 20 + 1):
        choices.append(choose(policy, 0, 2))
        assert policy.probing == (choices[-1] > 0)  # a probe: one request drafts
    tries = [i for i, k in enumerate(choices) if k]
    assert tries == [5, 16, 37, 58]  # waits of 5, 10, 20 and 20 plain decisions
    assert all(choices[i] == 3 for i in tries)
    policy.observe_step(8, 0.020, num_trees=1)  # measured again: 4 ms over plain
    # k=1: 6 tokens / 20 ms; k=2: 8 tokens / 22 ms; k=3: 8 tokens / 28 ms; k=0: 2 / 10 ms.
    assert choose(policy, 0, 2) == 2
    assert not policy.probing
    for _ in range(8):  # the tree turns dear again: its step times are the least of the last 8
        policy.observe_step(8, 0.500, num_trees=1)
    choices = [choose(policy, 0, 2) for _ in range(12)]
    assert choices == [0] * 5 + [3] + [0] * 6  # waits explore_every again


def test_explore_waits_must_be_ordered() -> None:
    with pytest.raises(ValueError, match="max_explore_every"):
        SpeculationPolicy(num_candidates=1, explore_every=100, max_explore_every=50)


def test_plain_steps_do_not_price_trees() -> None:
    """A prefill chunk of 16 rows is cheap per row; a speculative step of 16 rows (drafting,
    tree attention) is not. Only speculative steps price a tree."""
    policy = SpeculationPolicy(num_candidates=3, refresh_every=1000, alpha=1.0, min_samples=1)
    policy.observe_tree(TREE, [1, 2, 4, 8], Method.GREEDY)  # T = 3, 4, 4; S = 4, 5, 8
    for rows in (2, 8, 10, 16, 32):
        policy.observe_step(rows, 0.010 + 0.0005 * rows)  # plain: decodes and prefill chunks
    assert policy.predict_seconds(8, num_trees=2) is None
    for rows in (8, 10, 16):
        policy.observe_step(rows, 0.100, num_trees=2)
    assert choose(policy, 0, 2) == 0  # 2 tokens / 11 ms beats 6 tokens / 100 ms


def test_each_method_is_priced_by_its_own_acceptance() -> None:
    """Greedy requests that accept whole paths speculate while sampled ones that accept nothing
    decode plainly in the same step; a method whose full tree was never verified probes it."""
    policy = SpeculationPolicy(num_candidates=3, refresh_every=1000, alpha=1.0, min_samples=1)
    policy.observe_step(2, 0.010)
    policy.observe_step(16, 0.024)  # plain: 10 ms + 1 ms a row over 2
    policy.observe_tree(TREE, [1, 2, 4, 8], Method.GREEDY)  # greedy T = 3, 4, 4; S = 4, 5, 8
    for rows, seconds in [(4, 0.014), (8, 0.020), (16, 0.030)]:
        policy.observe_step(rows, seconds, num_trees=1)
    mixed = {Method.GREEDY: 1, Method.SAMPLE: 1}
    assert policy.choose(0, mixed) == {Method.SAMPLE: 3} and policy.probing
    policy.observe_tree(TREE, [9], Method.SAMPLE)  # sampled T = 1, 1, 1
    assert policy.acceptance[Method.GREEDY].tokens[1].value == 3  # untouched
    # greedy k=2 alone: 4 + 1 tokens / (plain 6 rows, 14 ms, + 3 ms excess) beat 2 / 10 ms,
    # k=1 (4 / 15.5 ms) and k=3 (5 / 21.25 ms); a sampled tree adds rows and gains nothing.
    assert policy.choose(0, mixed) == {Method.GREEDY: 2} and not policy.probing
    assert policy.choose(0, {Method.SAMPLE: 2}) == {}


class StepClock:
    """The engine's and drafter's `time`, whose perf_counter advances only by a cost model of
    the runner's steps (10 ms + 0.1 ms per token fed, like a model whose weights dominate) and
    1 ms per drafting, so the policy's choices do not depend on the host's load."""

    def __init__(self, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 0.0
        self.monotonic = time.monotonic
        execute = engine.runner.execute

        def timed_execute(seqs: list[SequenceInput]) -> ModelOutput:
            self.now += 0.010 + 0.0001 * sum(len(s.token_ids) for s in seqs)
            return execute(seqs)

        monkeypatch.setattr(engine.runner, "execute", timed_execute)
        monkeypatch.setattr("engine.core.time", self)
        monkeypatch.setattr("engine.spec_decode.drafter.time", self)

    def perf_counter(self) -> float:
        return self.now

    def drafting(self, proposer: Proposer) -> Proposer:
        propose = proposer.propose

        def timed_propose(
            inputs: Sequence[ProposalInput], max_candidates: int | None = None
        ) -> list[DraftTree]:
            self.now += 0.001
            return propose(inputs, max_candidates)

        proposer.propose = timed_propose  # type: ignore[method-assign]
        return proposer


def test_engine_stops_speculating_when_drafts_never_pay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = model_path("tiny-llama-gqa-tied")
    spec = write_tiny_speculator(tmp_path / "spec", path, n_predict=3)
    engine = make_engine(path)
    clock = StepClock(engine, monkeypatch)
    cfg = engine.runner.config
    speculator = load_speculator(
        spec, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, dtype=engine.runner.dtype,
        device="cpu",
    )  # fmt: skip
    proposer = MLPProposer(speculator, (5, 3, 2), 5)
    policy = SpeculationPolicy(proposer.num_candidates, refresh_every=1000)
    engine.drafter = Drafter(clock.drafting(proposer), policy, 16)
    prompt = list(chat_prompt_ids(path)[0])
    result = run(engine, [prompt], SamplingParams(max_new_tokens=64))
    compare_greedy(result.token_ids["0"], hf_greedy(path, tuple(prompt), 64))
    depths = [o.draft_depth for o in result.outputs["0"]]
    assert sum(d > 0 for d in depths[:6]) >= 1  # tried, after timing plain steps
    assert sum(d > 0 for d in depths[-20:]) <= 2  # then (nearly) never again: random drafts


def test_engine_keeps_speculating_when_drafts_pay(monkeypatch: pytest.MonkeyPatch) -> None:
    path = model_path("tiny-llama-gqa-tied")
    prompt = list(chat_prompt_ids(path)[1])
    ref = hf_greedy(path, tuple(prompt), 64)
    double = ScriptedProposer([prompt + ref.token_ids], accept_lengths=[4], num_heads=4)
    engine = make_engine(path)
    clock = StepClock(engine, monkeypatch)
    engine.drafter = Drafter(clock.drafting(double), SpeculationPolicy(1), 16)
    result = run(engine, [prompt], SamplingParams(max_new_tokens=64))
    compare_greedy(result.token_ids["0"], ref)
    assert len(result.outputs["0"]) <= 64 // 5 + 4


def test_a_refresh_gives_the_full_tree_to_one_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """With four requests speculating, a refresh verifies the full tree for one of them; the
    others keep the policy's choice, so a refresh costs one tree's rows, not four."""
    path = model_path("tiny-llama-gqa-tied")
    prompts = [list(p) for p in chat_prompt_ids(path)[:4]]
    refs = [hf_greedy(path, tuple(p), 32) for p in prompts]
    double = ScriptedProposer(
        [p + r.token_ids for p, r in zip(prompts, refs, strict=True)],
        accept_lengths=[1],
        num_heads=3,
        n_candidates=3,
    )
    engine = make_engine(path)
    clock = StepClock(engine, monkeypatch)
    policy = SpeculationPolicy(
        3, refresh_every=2, refresh_budget=float("inf"), alpha=1.0, min_samples=1
    )
    engine.drafter = Drafter(clock.drafting(double), policy, 16)
    candidates_per_step: list[list[int]] = []
    propose = engine.drafter.propose

    def recorded(
        view: DraftingView, hidden_states: dict[str, torch.Tensor]
    ) -> dict[str, DraftTree]:
        trees = propose(view, hidden_states)
        candidates_per_step.append(sorted(len(t.leaves) for t in trees.values()))
        return trees

    monkeypatch.setattr(engine.drafter, "propose", recorded)
    result = run(engine, prompts, SamplingParams(max_new_tokens=32))
    for i, ref in enumerate(refs):
        compare_greedy(result.token_ids[str(i)], ref)
    full_trees = [step.count(3) for step in candidates_per_step if len(step) == 4]
    assert full_trees and max(full_trees) == 1  # never more than one full tree in a step
    assert sum(full_trees) >= 2  # refreshes came
