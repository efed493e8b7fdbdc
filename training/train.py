"""Train an MLP speculator for an HF Llama folder and save it in the published accelerator format.

    specserve-train-speculator [train] --base MODEL_DIR [--name NAME | --out DIR]
        [--text FILE ...] [--prompts FILE ...] [--num-prompts N] [--epochs E] [--minutes M] ...
    specserve-train-speculator eval --speculator DIR [--base MODEL_DIR] [--prompts FILE ...]
    python -m training.train ...      (the same)

Recipe (after fms-fsdp; docs/training.md, "Recipe"): the base model is frozen; its final-norm
hidden states and tokens are the inputs; head i learns token t + 2 + i from state h_t and token
t + 1 by teacher forcing (MLPSpeculator.forward); the loss is the sum over heads of each head's
cross-entropy; AdamW (betas 0.9 / 0.95, weight decay 0.1 on matrices), parabolic warm-up then
cosine decay to 0.1 x the peak, gradient clipping at 1.0. Stage 1 trains on plain text
(`--text`), stage 2 on the base model's own answers to chat prompts (`--prompts`, else the
built-in training prompts of `training.prompts`). Deviations, for a small budget: the target is
the base model's own top-k prediction (self-distillation, see `training.data`), both stages share
one learning-rate schedule, the vocabulary matrices are trained factored over the base model's,
and the softmax runs over the draft vocabulary: by default the 4096 tokens most often the
teacher's top-1 (see `training_vocabulary` and `train_speculator`).

The output folder gets `config.json` and `model.safetensors` (loadable by
`engine.spec_decode.loader.load_speculator`), `draft_vocabulary.json` (the tokens the speculator
drafts from, unless `--vocabulary full`), `training.json` (settings, data, timings, loss and
evaluation), `train/checkpoint.pt` (for `--resume`) and `data/` (the cached training data). A
finished folder is left alone (its path printed) unless `--force`. The folder is always the last
line printed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.config import CANDIDATE_SELECTIONS
from engine.models.llama import LlamaConfig
from engine.paths import DEFAULT_MODEL_NAME, default_model_path, speculators_dir
from engine.spec_decode.loader import write_draft_vocabulary
from engine.spec_decode.mlp_speculator import MLPSpeculator
from engine.spec_decode.speculator_config import DRAFT_VOCABULARY_FILE, MLPSpeculatorConfig
from training.data import AnswerSettings, DataBuilder, SpeculatorData
from training.model import (
    MATRIX_MODES,
    TrainableSpeculator,
    distillation_loss,
    iter_unique_tensors,
    read_base_matrices,
)
from training.prompts import eval_prompts, read_prompts, read_texts, train_prompts

CHECKPOINT = Path("train") / "checkpoint.pt"
_FIT_FROM, _FIT_AT = 10, 60  # `minutes` fits the plan at step _FIT_AT, timing from _FIT_FROM
VOCABULARIES = ("frequent", "active", "full")


def default_speculator_name(base_path: str | Path) -> str:
    return f"{Path(base_path).name}-accelerator"


def default_speculator_path() -> Path:
    """Where `make speculator` puts the default model's speculator (it may not exist yet)."""
    return speculators_dir() / default_speculator_name(DEFAULT_MODEL_NAME)


@dataclass(frozen=True)
class TrainSettings:
    """Architecture (the speculator config's fields; `inner_dim` 0 means the base hidden size),
    how the vocabulary matrices train (`head` / `embedding`: factored, frozen or full), and the
    optimisation: `batch_size` positions per step, `epochs` over each stage's data (or fewer
    steps, to end within `minutes` of training when given), the teacher's `distill_top_k`
    tokens as soft targets, and the vocabulary the heads' softmax runs over (see
    `training_vocabulary`)."""

    n_predict: int = 3
    inner_dim: int = 0
    top_k_tokens_per_head: tuple[int, ...] = ()
    n_candidates: int = 5
    tie_weights: bool = False
    scale_input: bool = False
    head: str = "factored"
    embedding: str = "factored"
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.5
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    batch_size: int = 256
    epochs: float = 4.0
    minutes: float | None = None
    vocabulary: str = "frequent"
    vocabulary_size: int = 4096
    distill_top_k: int = 4
    seed: int = 0
    checkpoint_every: int = 100

    def speculator_config(self, base: LlamaConfig) -> MLPSpeculatorConfig:
        return MLPSpeculatorConfig(
            vocab_size=base.vocab_size,
            emb_dim=base.hidden_size,
            inner_dim=self.inner_dim or base.hidden_size,
            n_predict=self.n_predict,
            top_k_tokens_per_head=self.top_k_tokens_per_head,
            n_candidates=self.n_candidates,
            tie_weights=self.tie_weights,
            scale_input=self.scale_input,
        )


def training_vocabulary(
    stages: Sequence[SpeculatorData], settings: TrainSettings, vocab_size: int
) -> torch.Tensor:
    """[C] int64, sorted: the tokens the heads' softmax runs over in training, and the draft
    vocabulary of the trained speculator unless `full`. `frequent`: the `vocabulary_size`
    tokens most often the teacher's top-1 (ties to the one more often in its top
    `distill_top_k`, then to the lower id), so training and drafting skip the long tail that is
    almost never the token to draft; `active`: every token among the teacher's top
    `distill_top_k` at some row; `full`: the whole vocabulary."""
    if settings.vocabulary not in VOCABULARIES:
        raise ValueError(f"vocabulary must be one of {VOCABULARIES}, got {settings.vocabulary!r}")
    if settings.vocabulary == "full":
        return torch.arange(vocab_size)
    if settings.vocabulary == "active":
        return torch.unique(torch.cat([data.vocabulary(settings.distill_top_k) for data in stages]))
    if settings.vocabulary_size < 1:
        raise ValueError(f"vocabulary_size must be positive, got {settings.vocabulary_size}")
    top1 = sum((data.top_counts(vocab_size, 1) for data in stages), torch.zeros(vocab_size))
    top_k = sum(
        (data.top_counts(vocab_size, settings.distill_top_k) for data in stages),
        torch.zeros(vocab_size),
    )
    order = torch.sort(-top_k, stable=True).indices
    order = order[torch.sort(-top1[order], stable=True).indices]  # most frequent first
    return order[: settings.vocabulary_size].sort().values


def learning_rate(step: int, total: int, settings: TrainSettings) -> float:
    """Parabolic warm-up over `warmup_steps` (at most a fifth of the run), then cosine decay
    from `lr` to `min_lr_ratio * lr` at `total`."""
    warmup = min(settings.warmup_steps, max(1, total // 5))
    if step < warmup:
        return settings.lr * ((step + 1) / warmup) ** 2
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    floor = settings.min_lr_ratio
    return settings.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class TrainState:
    """Where a run stands: the next `step`, the planned steps per stage, and recent metrics."""

    step: int = 0
    plan: list[int] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.plan)


class Progress:
    """A tqdm bar when tqdm is installed, else a printed line every `every` steps."""

    def __init__(self, total: int, initial: int, every: int = 20) -> None:
        self.every = every
        self.total = total
        try:
            from tqdm import tqdm

            self.bar: Any = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
        except ImportError:
            self.bar = None

    def update(self, step: int, text: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        elif step % self.every == 0 or step == self.total:
            print(f"step {step}/{self.total} {text}", flush=True)

    def set_total(self, total: int) -> None:
        self.total = total
        if self.bar is not None:
            self.bar.total = total
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _seeded(*parts: int) -> torch.Generator:
    seed = 0
    for p in parts:
        seed = (seed * 1_000_003 + p) % (2**63)
    return torch.Generator().manual_seed(seed)


def train_speculator(
    model: TrainableSpeculator,
    stages: Sequence[SpeculatorData],
    settings: TrainSettings,
    *,
    checkpoint: Path | None = None,
    resume: bool = False,
    device: str = "cpu",
    stop_at: int | None = None,
    vocab_ids: torch.Tensor | None = None,
    log: Callable[[str], None] = print,
) -> TrainState:
    """Train `model` in place on each stage's data in turn (`epochs` passes each, positions
    shuffled per epoch; with `minutes`, the plan shrinks after 60 steps, at the pace of steps
    10-60 (the first ones are slower), so that training ends in time), the heads' softmax over
    `vocab_ids` (default: `training_vocabulary`). Saves optimizer and step to `checkpoint`
    every `checkpoint_every` steps and at the end; with `resume`, continues from it exactly
    (same batches, same learning rates). `stop_at` ends this call early, after that step,
    leaving a resumable checkpoint. Returns the state reached."""
    model.to(device)
    optimizer = torch.optim.AdamW(
        model.parameter_groups(settings.weight_decay),
        lr=settings.lr,
        betas=settings.betas,
        weight_decay=settings.weight_decay,
    )
    rows = [data.trainable_rows() for data in stages]
    if vocab_ids is None:
        vocab_ids = training_vocabulary(stages, settings, model.config.vocab_size)
    per_epoch = [math.ceil(len(r) / settings.batch_size) for r in rows]
    state = TrainState(plan=[math.ceil(settings.epochs * n) for n in per_epoch])
    if resume and checkpoint is not None and checkpoint.is_file():
        saved = torch.load(checkpoint, map_location=device, weights_only=False)
        if saved["settings"] != asdict(settings):
            raise ValueError(f"{checkpoint}: saved with other settings; train afresh or --force")
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        state = TrainState(saved["step"], saved["plan"], saved["history"], saved["seconds"])
        log(f"resuming at step {state.step} of {state.total}")
    if state.total == 0:
        raise ValueError("no training positions: give prompts or text with at least 2 tokens")

    def save() -> None:
        if checkpoint is None:
            return
        checkpoint.parent.mkdir(parents=True, exist_ok=True)
        tmp = checkpoint.with_suffix(".tmp")
        torch.save(
            {
                "settings": asdict(settings),
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "step": state.step,
                "plan": state.plan,
                "history": state.history,
                "seconds": state.seconds,
            },
            tmp,
        )
        tmp.replace(checkpoint)

    progress = Progress(state.total, state.step)
    started, timed_from = time.perf_counter(), state.step
    fit_mark = 0.0  # training seconds at step timed_from + _FIT_FROM
    running: list[torch.Tensor] = []
    model.train()
    step = 0  # global index of the batch being considered
    stage_start = 0
    for stage, data in enumerate(stages):
        for epoch in range(math.ceil(state.plan[stage] / max(1, per_epoch[stage]))):
            if stage_start + (epoch + 1) * per_epoch[stage] <= state.step:
                continue  # wholly done before a resume
            shuffle = _seeded(settings.seed, stage, epoch)
            order = rows[stage][torch.randperm(len(rows[stage]), generator=shuffle)]
            for b in range(per_epoch[stage]):
                step = stage_start + epoch * per_epoch[stage] + b
                if step >= stage_start + state.plan[stage]:
                    break
                if step < state.step:
                    continue
                if stop_at is not None and step >= stop_at:
                    break
                batch = data.batch(
                    order[b * settings.batch_size : (b + 1) * settings.batch_size],
                    model.config.n_predict,
                    settings.distill_top_k,
                ).to(device)
                lr = learning_rate(step, state.total, settings)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                out = distillation_loss(model, batch, vocab_ids)
                optimizer.zero_grad(set_to_none=True)
                out.loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
                optimizer.step()
                state.step = step + 1
                running.append(torch.cat([out.loss.detach()[None], out.head_accuracy]).cpu())
                running = running[-20:]
                mean = torch.stack(running).mean(0)
                accuracy = " ".join(f"{a:.2f}" for a in mean[1:].tolist())
                progress.update(state.step, f"loss {mean[0]:.3f} acc {accuracy} lr {lr:.1e}")
                elapsed = time.perf_counter() - started
                if state.step % 50 == 0 or state.step == state.total:
                    state.history.append(
                        {
                            "step": state.step,
                            "seconds": state.seconds + elapsed,
                            "loss": round(float(mean[0]), 4),
                            "accuracy": [round(a, 4) for a in mean[1:].tolist()],
                        }
                    )
                if settings.minutes and state.step == timed_from + _FIT_FROM:
                    fit_mark = state.seconds + elapsed
                if settings.minutes and state.step == timed_from + _FIT_AT:
                    _fit_plan(
                        state,
                        settings.minutes * 60 - state.seconds - elapsed,
                        (state.seconds + elapsed - fit_mark) / (_FIT_AT - _FIT_FROM),
                        stage,
                        step + 1 - stage_start,
                    )
                    progress.set_total(state.total)
                if state.step % settings.checkpoint_every == 0:
                    state.seconds += elapsed
                    started = time.perf_counter()
                    save()
        stage_start += state.plan[stage]
    state.seconds += time.perf_counter() - started
    progress.close()
    save()
    model.eval()
    return state


def _fit_plan(
    state: TrainState, seconds_left: float, step_seconds: float, stage: int, done: int
) -> None:
    """Shrink the steps still planned (the rest of `stage`, `done` steps into it, and the later
    stages) by one factor so that they take at most `seconds_left` at `step_seconds` each."""
    affordable = int(max(0.0, seconds_left) / step_seconds)
    remaining = [state.plan[stage] - done, *state.plan[stage + 1 :]]
    if sum(remaining) <= affordable:
        return
    factor = affordable / sum(remaining)
    state.plan[stage] = done + int(remaining[0] * factor)
    for s in range(stage + 1, len(state.plan)):
        state.plan[s] = int(state.plan[s] * factor)


def save_speculator(
    model: MLPSpeculator, out_dir: str | Path, draft_vocabulary: torch.Tensor | None = None
) -> Path:
    """Write `config.json` and `model.safetensors` (keys with the HF wrapper's `speculator.`
    prefix; a tied speculator stores each shared tensor once) into `out_dir`, and the
    `draft_vocabulary` file when given (else remove a stale one)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if draft_vocabulary is not None:
        write_draft_vocabulary(out, draft_vocabulary)
    else:
        (out / DRAFT_VOCABULARY_FILE).unlink(missing_ok=True)
    tensors = {f"speculator.{name}": t.cpu() for name, t in iter_unique_tensors(model)}
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / "model.safetensors")
    (out / "model.safetensors").chmod(0o644)
    (out / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
    return out


def _parse_ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _train_parser() -> argparse.ArgumentParser:
    d = TrainSettings()
    a = AnswerSettings()
    p = argparse.ArgumentParser(
        prog="specserve-train-speculator",
        description="Train an MLP speculator for an HF Llama folder (subcommand `eval` scores "
        "one). Prints the speculator folder last.",
    )
    p.add_argument("--base", type=Path, default=None, help="base HF Llama folder (default model)")
    p.add_argument("--name", help="folder name under $SPECSERVE_HOME/speculators")
    p.add_argument("--out", type=Path, help="output folder (overrides --name)")
    p.add_argument("--data-dir", type=Path, help="data cache (default OUT/data)")
    p.add_argument("--text", nargs="*", default=[], help="stage-1 text files (.txt or .jsonl)")
    p.add_argument("--prompts", nargs="*", default=[], help="stage-2 prompt files (.jsonl/.txt)")
    p.add_argument("--num-prompts", type=int, default=1024, help="prompts answered for stage 2")
    p.add_argument("--max-new-tokens", type=int, default=a.max_new_tokens)
    p.add_argument("--sampled-fraction", type=float, default=a.sampled_fraction)
    p.add_argument("--temperature", type=float, default=a.temperature)
    p.add_argument("--gen-batch-size", type=int, default=a.batch_size)
    p.add_argument("--n-predict", type=int, default=d.n_predict)
    p.add_argument("--inner-dim", type=int, default=d.inner_dim, help="0: the base hidden size")
    p.add_argument("--top-k-tokens-per-head", type=_parse_ints, default=d.top_k_tokens_per_head)
    p.add_argument("--n-candidates", type=int, default=d.n_candidates)
    p.add_argument("--tie-weights", action="store_true")
    p.add_argument("--scale-input", action="store_true")
    p.add_argument("--head", choices=MATRIX_MODES, default=d.head)
    p.add_argument("--embedding", choices=MATRIX_MODES, default=d.embedding)
    p.add_argument("--freeze-head", action="store_true", help="the same as --head frozen")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="positions per step")
    p.add_argument("--epochs", type=float, default=d.epochs)
    p.add_argument("--minutes", type=float, default=None, help="training time budget")
    p.add_argument("--vocabulary", choices=VOCABULARIES, default=d.vocabulary)
    p.add_argument("--vocabulary-size", type=int, default=d.vocabulary_size, help="`frequent`'s")
    p.add_argument("--distill-top-k", type=int, default=d.distill_top_k)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--resume", action="store_true", help="continue from OUT/train/checkpoint.pt")
    p.add_argument("--force", action="store_true", help="retrain even if OUT is finished")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="base model dtype (default: the engine's)")
    p.add_argument("--eval-prompts", type=int, default=48, help="held-out prompts (0: no eval)")
    p.add_argument("--eval-max-new-tokens", type=int, default=128)
    return p


def train_main(argv: Sequence[str]) -> Path:
    args = _train_parser().parse_args(argv)
    base = Path(args.base or default_model_path()).expanduser()
    out = args.out or speculators_dir() / (args.name or default_speculator_name(base))
    out = Path(out).expanduser()
    finished = (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    if finished and not (args.force or args.resume):
        print(f"{out} exists; --force to retrain", flush=True)
        return out
    settings = TrainSettings(
        n_predict=args.n_predict,
        inner_dim=args.inner_dim,
        top_k_tokens_per_head=args.top_k_tokens_per_head,
        n_candidates=args.n_candidates,
        tie_weights=args.tie_weights,
        scale_input=args.scale_input,
        head="frozen" if args.freeze_head else args.head,
        embedding=args.embedding,
        lr=args.lr,
        batch_size=args.batch_size,
        epochs=args.epochs,
        minutes=args.minutes,
        vocabulary=args.vocabulary,
        vocabulary_size=args.vocabulary_size,
        distill_top_k=args.distill_top_k,
        seed=args.seed,
    )
    answer_settings = AnswerSettings(
        max_new_tokens=args.max_new_tokens,
        sampled_fraction=args.sampled_fraction,
        temperature=args.temperature,
        batch_size=args.gen_batch_size,
        seed=args.seed,
    )
    base_config = LlamaConfig.from_folder(base)
    config = settings.speculator_config(base_config)  # validates the tree shape early
    report: dict[str, Any] = {"base": str(base), "settings": asdict(settings)}
    report["answer_settings"] = asdict(answer_settings)
    started = time.perf_counter()

    prompts = read_prompts(args.prompts) if args.prompts else train_prompts()
    prompts = prompts[: args.num_prompts]
    texts = read_texts(args.text)
    builder = DataBuilder(
        base,
        args.data_dir or out / "data",
        device=args.device,
        dtype=args.dtype,
        settings=answer_settings,
    )
    stages = []
    if texts:
        stages.append(builder.text(texts))
    if prompts:
        stages.append(builder.answers(prompts))
    builder.close()
    report["data"] = {
        "num_prompts": len(prompts),
        "num_texts": len(texts),
        "positions": [len(s) for s in stages],
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(f"data: {report['data']}", flush=True)

    model = TrainableSpeculator(
        config,
        read_base_matrices(base),
        head=settings.head,
        embedding=settings.embedding,
        seed=settings.seed,
    )
    vocab_ids = training_vocabulary(stages, settings, config.vocab_size)
    state = train_speculator(
        model,
        stages,
        settings,
        checkpoint=out / CHECKPOINT,
        resume=args.resume,
        device=args.device,
        vocab_ids=vocab_ids,
    )
    draft_vocabulary = None if settings.vocabulary == "full" else vocab_ids
    save_speculator(model.cpu().export(), out, draft_vocabulary)
    report["training"] = {"steps": state.step, "seconds": round(state.seconds, 1)}
    report["history"] = state.history
    if args.eval_prompts:
        from training.evaluate import evaluate_speculator

        stats = evaluate_speculator(
            base,
            out,
            eval_prompts()[: args.eval_prompts],
            max_new_tokens=args.eval_max_new_tokens,
            device=args.device,
            dtype=args.dtype,
        )
        print(stats.table(), flush=True)
        report["eval"] = stats.to_dict()
    report["seconds"] = round(time.perf_counter() - started, 1)
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"trained in {report['seconds'] / 60:.1f} min", flush=True)
    return out


def eval_main(argv: Sequence[str]) -> Path:
    p = argparse.ArgumentParser(
        prog="specserve-train-speculator eval",
        description="Tokens per step and per-head acceptance of a speculator under tree "
        "verification, greedy or sampled (--temperature), on the built-in held-out chat prompts "
        "(or --prompts files).",
    )
    p.add_argument("--speculator", type=Path, default=None, help="default: the default model's")
    p.add_argument("--base", type=Path, default=None, help="default: from training.json")
    p.add_argument("--prompts", nargs="*", default=[])
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--top-k-tokens-per-head", type=_parse_ints, default=None)
    p.add_argument("--n-candidates", type=int, default=None)
    p.add_argument(
        "--selection", choices=CANDIDATE_SELECTIONS, default="coverage", help="candidate picking"
    )
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="prompt k samples with seed + k")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--json", type=Path, help="also write the numbers here")
    args = p.parse_args(argv)
    speculator = Path(args.speculator or default_speculator_path()).expanduser()
    base = args.base
    if base is None:
        report = speculator / "training.json"
        base = Path(json.loads(report.read_text())["base"]) if report.is_file() else None
    prompts = read_prompts(args.prompts) if args.prompts else eval_prompts()
    from training.evaluate import evaluate_speculator

    stats = evaluate_speculator(
        base or default_model_path(),
        speculator,
        prompts[: args.num_prompts],
        max_new_tokens=args.max_new_tokens,
        top_k_tokens_per_head=args.top_k_tokens_per_head,
        n_candidates=args.n_candidates,
        candidate_selection=args.selection,
        batch_size=args.batch_size,
        device=args.device,
        dtype=args.dtype,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
    )
    print(stats.table(), flush=True)
    if args.json:
        args.json.write_text(json.dumps(stats.to_dict(), indent=2) + "\n")
    return speculator


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["eval"]:
        path = eval_main(argv[1:])
    else:
        path = train_main(argv[1:] if argv[:1] == ["train"] else argv)
    print(path, flush=True)


if __name__ == "__main__":
    main()
