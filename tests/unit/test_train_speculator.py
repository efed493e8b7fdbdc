"""The speculator training tool: data alignment, loss, export/save/load, resume, evaluation."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.models.llama import LlamaConfig
from engine.paths import model_path
from engine.spec_decode.loader import load_speculator
from tests.families import checkpoint
from tests.reference import require_model
from training.data import TEACHER_TOP_K, AnswerSettings, DataBuilder, SpeculatorData
from training.evaluate import evaluate_speculator
from training.model import (
    BaseMatrices,
    TrainableSpeculator,
    distillation_loss,
    read_base_matrices,
)
from training.prompts import NUM_EVAL_PROMPTS, builtin_prompts, eval_prompts
from training.train import (
    TrainSettings,
    learning_rate,
    save_speculator,
    train_speculator,
    training_vocabulary,
)

TINY = "tiny-llama-gqa-tied"


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny tensors: one thread avoids OpenMP hand-offs that dominate on a busy 2-core box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny() -> Path:
    return require_model(model_path(TINY))


@pytest.fixture(scope="module")
def base(tiny: Path) -> BaseMatrices:
    return read_base_matrices(tiny)


def synthetic_data(hidden: int, vocab: int, rows: int = 96, seed: int = 0) -> SpeculatorData:
    """Sequences of 24 positions with a learnable rule: the teacher's top token after x is
    (7 x + 3) mod 50, plus random states."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50, (rows,), generator=g)
    top1 = (7 * tokens + 3) % 50
    others = torch.randint(50, vocab, (rows, TEACHER_TOP_K - 1), generator=g)
    logprobs = torch.linspace(-0.1, -6.0, TEACHER_TOP_K).expand(rows, -1).contiguous()
    valid = torch.ones(rows, dtype=torch.bool)
    valid[23::24] = False  # each sequence ends with EOS
    return SpeculatorData(
        states=torch.randn(rows, hidden, generator=g),
        tokens=tokens,
        teacher_ids=torch.cat([top1[:, None], others], dim=1),
        teacher_logprobs=logprobs,
        teacher_valid=valid,
        sequence=torch.arange(rows) // 24,
    )


def make_settings(**overrides: object) -> TrainSettings:
    defaults: dict[str, object] = dict(
        lr=3e-3, warmup_steps=2, batch_size=32, epochs=2, checkpoint_every=1000
    )
    return replace(TrainSettings(), **(defaults | overrides))  # type: ignore[arg-type]


def build(tiny: Path, base: BaseMatrices, settings: TrainSettings) -> TrainableSpeculator:
    config = settings.speculator_config(LlamaConfig.from_folder(tiny))
    return TrainableSpeculator(
        config, base, head=settings.head, embedding=settings.embedding, seed=settings.seed
    )


def quiet(_: str) -> None:
    pass


def test_builtin_prompts_hold_out_the_eval_set() -> None:
    prompts = builtin_prompts()
    assert len(prompts) >= 300 and len(set(prompts)) == len(prompts)
    held_out = eval_prompts()
    assert held_out == prompts[:NUM_EVAL_PROMPTS]
    train = set(prompts[NUM_EVAL_PROMPTS:])
    assert not train & set(held_out)
    for subject in ("glaciers", "origami", "palindrome", "serendipity", "cast iron"):
        assert any(subject in p for p in held_out)
        assert not any(subject in p for p in train)
    bench = pytest.importorskip("bench.chat_prompts")
    assert not set(bench.SERVING_PROMPTS) & set(prompts)


def test_batch_aligns_heads_within_a_sequence() -> None:
    data = synthetic_data(8, 100, rows=48)
    batch = data.batch(torch.tensor([0, 21, 22, 47]), n_predict=3, top_k=2)
    assert batch.token_ids.shape == (4, 4)
    assert batch.token_ids[0].tolist() == data.tokens[0:4].tolist()
    assert batch.target_ids[:, 0, 0].tolist() == data.teacher_ids[0:3, 0].tolist()
    # row 21: heads read rows 21, 22, 23; row 23 is the EOS row of sequence 0
    assert batch.mask[:, 1].tolist() == [True, True, False]
    # row 22: head 2 would read row 24, the next sequence
    assert batch.mask[:, 2].tolist() == [True, False, False]
    assert batch.mask[:, 3].tolist() == [False, False, False]  # the last row is an EOS row


def test_learning_rate_warms_up_then_decays() -> None:
    s = make_settings(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    rates = [learning_rate(step, 100, s) for step in range(100)]
    assert rates[0] < rates[5] < rates[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in itertools.pairwise(rates[9:]))
    assert rates[-1] == pytest.approx(1e-4, rel=0.05)


def test_training_lowers_the_loss_on_a_fixed_batch(tiny: Path, base: BaseMatrices) -> None:
    settings = make_settings(batch_size=96, epochs=30)
    model = build(tiny, base, settings)
    data = synthetic_data(model.config.emb_dim, model.config.vocab_size)
    batch = data.batch(data.trainable_rows(), model.config.n_predict, settings.distill_top_k)
    vocab_ids = data.vocabulary(settings.distill_top_k)
    with torch.no_grad():
        before = distillation_loss(model, batch, vocab_ids)
    state = train_speculator(model, [data], settings, log=quiet)
    assert state.step == 30
    with torch.no_grad():
        after = distillation_loss(model, batch, vocab_ids)
    assert after.loss < 0.8 * before.loss
    assert after.head_accuracy[0] > before.head_accuracy[0]


def test_a_time_budget_cuts_the_plan_after_sixty_steps(tiny: Path, base: BaseMatrices) -> None:
    data = synthetic_data(64, 49152)  # 3 batches of 32 per epoch
    settings = make_settings(epochs=30, minutes=1e-5)
    state = train_speculator(build(tiny, base, settings), [data], settings, log=quiet)
    assert (state.step, state.total) == (60, 60)
    roomy = replace(settings, minutes=60.0)
    state = train_speculator(build(tiny, base, roomy), [data], roomy, log=quiet)
    assert (state.step, state.total) == (90, 90)


def test_loss_over_a_partial_vocabulary_matches_a_per_position_oracle(
    tiny: Path, base: BaseMatrices
) -> None:
    """Targets outside the vocabulary drop out of the teacher's distribution, and positions
    with none inside drop out of the mean: checked against a loop over positions."""
    settings = make_settings()
    model = build(tiny, base, settings)
    data = synthetic_data(model.config.emb_dim, model.config.vocab_size, rows=48)
    batch = data.batch(data.trainable_rows(), model.config.n_predict, top_k=3)
    g = torch.Generator().manual_seed(3)
    candidates = torch.unique(batch.target_ids)
    vocab_ids = candidates[torch.randperm(len(candidates), generator=g)[: len(candidates) // 2]]
    vocab_ids = vocab_ids.sort().values
    with torch.no_grad():
        out = distillation_loss(model, batch, vocab_ids)
        features = model(batch.states, batch.token_ids)
    inside = set(vocab_ids.tolist())
    for i, head in enumerate(model.heads()):
        rows = head.rows(vocab_ids)
        losses, hits = [], []
        for n in range(batch.states.shape[0]):
            targets = [
                (vocab_ids.tolist().index(t), lp)
                for t, lp in zip(
                    batch.target_ids[i, n].tolist(),
                    batch.target_logprobs[i, n].tolist(),
                    strict=True,
                )
                if t in inside
            ]
            if not batch.mask[i, n] or not targets:
                continue
            logprobs = (features[i, n] @ rows.t()).double().log_softmax(-1)
            weights = torch.tensor([lp for _, lp in targets], dtype=torch.float64).softmax(-1)
            losses.append(-sum(w * logprobs[j] for w, (j, _) in zip(weights, targets, strict=True)))
            top1 = int(batch.target_ids[i, n, 0])
            hits.append(top1 in inside and int(logprobs.argmax()) == targets[0][0])
        assert 0 < len(losses) < int(batch.mask[i].sum())  # some positions lost every target
        assert float(out.head_losses[i]) == pytest.approx(
            float(sum(losses) / len(losses)), rel=1e-4
        )
        assert float(out.head_accuracy[i]) == pytest.approx(sum(hits) / len(hits), abs=1e-6)


def test_a_frequent_vocabulary_trains_and_becomes_the_draft_vocabulary(
    tiny: Path, base: BaseMatrices, tmp_path: Path
) -> None:
    settings = make_settings(epochs=1, vocabulary="frequent", vocabulary_size=60)
    model = build(tiny, base, settings)
    vocab = model.config.vocab_size
    data = synthetic_data(model.config.emb_dim, vocab)
    top1: dict[int, int] = {}
    top_k: dict[int, int] = {}
    for ids, valid in zip(data.teacher_ids.tolist(), data.teacher_valid.tolist(), strict=True):
        top1[ids[0]] = top1.get(ids[0], 0) + valid
        for t in ids[: settings.distill_top_k]:
            top_k[t] = top_k.get(t, 0) + valid
    ranked = sorted(range(vocab), key=lambda t: (-top1.get(t, 0), -top_k.get(t, 0), t))
    vocab_ids = training_vocabulary([data], settings, vocab)
    assert vocab_ids.tolist() == sorted(ranked[:60])
    active = training_vocabulary([data], replace(settings, vocabulary="active"), vocab)
    assert active.tolist() == sorted(
        set(data.teacher_ids[:, : settings.distill_top_k].flatten().tolist())
    )
    assert torch.equal(
        training_vocabulary([data], replace(settings, vocabulary="full"), vocab),
        torch.arange(vocab),
    )
    with pytest.raises(ValueError, match="vocabulary must be one of"):
        training_vocabulary([data], replace(settings, vocabulary="most"), vocab)

    train_speculator(model, [data], settings, vocab_ids=vocab_ids, log=quiet)
    exported = model.export()
    folder = save_speculator(exported, tmp_path / "spec", vocab_ids)
    config = LlamaConfig.from_folder(tiny)
    loaded = load_speculator(
        folder, hidden_size=config.hidden_size, vocab_size=vocab, dtype=torch.float32, device="cpu"
    )
    assert loaded.draft_vocabulary is not None
    assert loaded.draft_vocabulary.tolist() == vocab_ids.tolist()
    for i in range(loaded.config.n_predict):
        assert torch.equal(loaded.head[i].weight, exported.head[i].weight[vocab_ids])
    paths, _ = loaded.draft_candidates(data.states[:4], data.tokens[:4], (5, 3, 2), 5)
    assert set(paths.flatten().tolist()) <= set(vocab_ids.tolist())
    save_speculator(exported, folder)  # no draft vocabulary: the stale file goes
    again = load_speculator(
        folder, hidden_size=config.hidden_size, vocab_size=vocab, dtype=torch.float32, device="cpu"
    )
    assert again.draft_vocabulary is None


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"inner_dim": 48},
        {"tie_weights": True, "scale_input": True},
        {"n_predict": 4, "top_k_tokens_per_head": (3, 2, 2, 1), "n_candidates": 4},
        {"head": "frozen", "embedding": "full"},
        {"head": "full", "embedding": "frozen", "tie_weights": True, "inner_dim": 64},
    ],
    ids=["default", "inner-48", "tied-scaled", "n4", "frozen-head", "full-head-tied"],
)
def test_saved_speculator_loads_with_identical_logits(
    tiny: Path, base: BaseMatrices, tmp_path: Path, overrides: dict
) -> None:
    settings = make_settings(epochs=1, **overrides)
    model = build(tiny, base, settings)
    data = synthetic_data(model.config.emb_dim, model.config.vocab_size)
    train_speculator(model, [data], settings, log=quiet)
    exported = model.export()
    folder = save_speculator(exported, tmp_path / "spec")
    config = LlamaConfig.from_folder(tiny)
    loaded = load_speculator(
        folder,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        dtype=torch.float32,
        device="cpu",
    )
    assert loaded.config == exported.config == model.config
    state = data.states[:5, None, :]
    tokens = data.tokens[: 5 + model.config.n_predict].unfold(0, model.config.n_predict + 1, 1)
    with torch.no_grad():
        want = exported(state, tokens)  # [n, 5, 1, vocab]
        assert torch.equal(loaded(state, tokens), want)
        features = model(state[:, 0], tokens)  # [n, 5, F]
        for i, head in enumerate(model.heads()):
            full = features[i] @ head.rows(torch.arange(config.vocab_size)).t()
            torch.testing.assert_close(full, want[i, :, 0], rtol=1e-4, atol=1e-4)
    if model.config.tie_weights:
        from safetensors import safe_open

        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            names = set(f.keys())
        assert "speculator.head.0.weight" in names and "speculator.head.1.weight" not in names


def test_resume_continues_at_the_saved_step(tiny: Path, base: BaseMatrices, tmp_path: Path) -> None:
    settings = make_settings(epochs=3, checkpoint_every=2)
    data = synthetic_data(64, 49152)
    checkpoint = tmp_path / "checkpoint.pt"

    straight = build(tiny, base, settings)
    train_speculator(straight, [data], settings, log=quiet)

    first = build(tiny, base, settings)
    state = train_speculator(first, [data], settings, checkpoint=checkpoint, stop_at=5, log=quiet)
    assert state.step == 5
    assert torch.load(checkpoint, weights_only=False)["step"] == 5

    messages: list[str] = []
    resumed = build(tiny, base, settings)
    state = train_speculator(
        resumed, [data], settings, checkpoint=checkpoint, resume=True, log=messages.append
    )
    assert messages == ["resuming at step 5 of 9"]
    assert state.step == 9
    for (name, a), (_, b) in zip(
        straight.named_parameters(), resumed.named_parameters(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="other settings"):
        train_speculator(
            build(tiny, base, settings),
            [data],
            replace(settings, lr=1.0),
            checkpoint=checkpoint,
            resume=True,
            log=quiet,
        )


def test_data_from_the_engine_and_offline_eval(tiny: Path, tmp_path: Path) -> None:
    settings = AnswerSettings(max_new_tokens=8, sampled_fraction=0.0, batch_size=4, chunk_size=4)
    prompts = ["Tell me about the sea.", "Count to five.", "Name a color.", "Say hello."]
    builder = DataBuilder(tiny, tmp_path / "data", settings=settings, progress=quiet)
    data = builder.answers(prompts)
    builder.close()
    hidden = LlamaConfig.from_folder(tiny).hidden_size
    assert data.states.shape == (len(data), hidden) and len(data) >= 4
    # greedy answers: the teacher's top token after x_{t+1} is the answer's next token
    same = data.sequence[1:] == data.sequence[:-1]
    agree = (data.teacher_ids[:-1, 0] == data.tokens[1:])[same]
    assert agree.float().mean() > 0.9
    again = DataBuilder(tiny, tmp_path / "data", settings=settings, progress=quiet)
    cached = again.answers(prompts)
    assert again._llm is None  # served from the cache, no engine built
    assert torch.equal(cached.states, data.states)

    spec = TrainSettings(inner_dim=32, epochs=1, batch_size=16)
    model = build(tiny, read_base_matrices(tiny), spec)
    train_speculator(model, [data], spec, log=quiet)
    folder = save_speculator(model.export(), tmp_path / "spec")
    stats = evaluate_speculator(tiny, folder, prompts[:2], max_new_tokens=6, batch_size=2)
    assert stats.num_prompts == 2 and stats.generated_tokens == 12
    assert stats.num_steps > 0 and stats.num_steps <= stats.num_tokens <= 4 * stats.num_steps
    assert stats.reached[0] == stats.num_steps
    assert "tokens per step" in stats.table()
    sampled = evaluate_speculator(
        tiny, folder, prompts[:2], max_new_tokens=6, batch_size=2, temperature=0.7, top_p=0.9
    )
    assert sampled.generated_tokens == 12 and sampled.num_steps > 0
    assert sampled.num_steps <= sampled.num_tokens <= 4 * sampled.num_steps
    assert "sampled at temperature 0.7, top-p 0.9" in sampled.table()


def test_answer_rows_match_a_prefill_pass_over_the_same_sequences(
    tiny: Path, tmp_path: Path
) -> None:
    """The states and teachers recorded while decoding equal those a prefill pass of the same
    runner computes over each finished sequence (the independent oracle), row for row."""
    settings = AnswerSettings(max_new_tokens=12, temperature=1.0, top_k=50, batch_size=3)
    builder = DataBuilder(tiny, tmp_path / "data", settings=settings, progress=quiet)
    prompts = [[5, 9, 2], [7, 7, 1, 4, 30], [11], [3, 8]]
    answers = dict(
        builder.generate([(f"r{i}", p, i % 2 == 1, 100 + i) for i, p in enumerate(prompts)])
    )
    for i, prompt in enumerate(prompts):
        answer = answers[f"r{i}"]
        rows = answer.rows(0)
        assert rows is not None and len(rows) == len(answer.token_ids) - 1
        reference = builder.collect([prompt + answer.token_ids], [len(prompt) - 1], [False])
        n = len(rows)
        torch.testing.assert_close(rows.states, reference.states[:n], atol=1e-4, rtol=1e-4)
        assert torch.equal(rows.tokens, reference.tokens[:n])
        assert torch.equal(rows.teacher_ids[:, 0], reference.teacher_ids[:n, 0])
        torch.testing.assert_close(
            rows.teacher_logprobs, reference.teacher_logprobs[:n], atol=1e-4, rtol=1e-4
        )
    builder.close()


@pytest.mark.parametrize("variant", ["granite-untied", "mistral", "qwen2"])
def test_trains_and_serves_for_each_model_family(variant: str, tmp_path: Path) -> None:
    """Data from the engine, a short training and the offline evaluation (the speculator
    drafting and its trees verified) run unchanged on every family's checkpoint."""
    path = checkpoint(variant)
    settings = AnswerSettings(max_new_tokens=8, sampled_fraction=0.0, batch_size=2, chunk_size=2)
    prompts = ["Tell me about the sea.", "Count to five."]
    builder = DataBuilder(path, tmp_path / "data", settings=settings, progress=quiet)
    data = builder.answers(prompts)
    builder.close()
    assert data.states.shape == (len(data), LlamaConfig.from_folder(path).hidden_size)
    spec = TrainSettings(inner_dim=32, epochs=1, batch_size=16)
    model = build(path, read_base_matrices(path), spec)
    train_speculator(model, [data], spec, log=quiet)
    folder = save_speculator(model.export(), tmp_path / "spec")
    stats = evaluate_speculator(path, folder, prompts, max_new_tokens=6, batch_size=2)
    assert stats.generated_tokens == 12 and stats.num_steps > 0
