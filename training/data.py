"""Training data for MLP speculators, made by the base model and cached on disk.

Stage 2 data are the base model's own answers to chat prompts (greedy, and a seeded sampled
share), generated in large batches by this project's engine; stage 1 data are windows of plain
text. Every trained position t of a sequence gives one row:

    state    h_t        the final-norm hidden state after reading x_0..x_t (what the engine hands
                        the speculator at inference)
    token    x_{t+1}    the token the sequence continues with (the speculator's first input)
    teacher  top-k of the base model's next-token log-probabilities after x_0..x_{t+1}

so head i at position t is taught the base model's own prediction for x_{t+2+i}: on greedy
answers that is the answer's next token, and on sampled answers and text it is the token greedy
verification would accept after that prefix. Answers take states and teachers from the decode
steps that generated them (a `StateRecorder` observing the engine), exactly the numbers the
engine feeds the speculator when serving, at no extra cost; text takes them from prefill passes
of the engine's ModelRunner.

Each chunk of sequences is one safetensors shard in the cache folder, named by a hash of
everything that determines it (base model, prompts or text, settings), so reruns load it and a
larger run reuses the smaller run's shards.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.hooks import StateRecorder, StepStates
from engine.llm import LLM
from engine.sampling.params import SamplingParams
from engine.step_io import SequenceInput
from training.prompts import chat_prompt_ids

logger = logging.getLogger(__name__)

TEACHER_TOP_K = 8
_FORMAT_VERSION = 2


@dataclass(frozen=True)
class AnswerSettings:
    """How stage-2 answers are generated: `max_new_tokens` per answer; a `sampled_fraction` of
    the prompts (chosen by `seed`) is answered by seeded sampling at `temperature` / `top_k`,
    the rest greedily; `batch_size` requests decode together; `chunk_size` prompts per shard."""

    max_new_tokens: int = 256
    sampled_fraction: float = 0.25
    temperature: float = 0.8
    top_k: int = 20
    batch_size: int = 128
    chunk_size: int = 128
    seed: int = 0


@dataclass
class Batch:
    """One training batch of N positions for n heads."""

    states: torch.Tensor  # [N, hidden] float32
    token_ids: torch.Tensor  # [N, n + 1] int64: column i is stage i's input token
    target_ids: torch.Tensor  # [n, N, k] int64: the teacher's top-k for head i
    target_logprobs: torch.Tensor  # [n, N, k] float32
    mask: torch.Tensor  # [n, N] bool: head i has a target at this position

    def to(self, device: str | torch.device) -> Batch:
        return Batch(*(getattr(self, f.name).to(device) for f in fields(self)))


@dataclass
class SpeculatorData:
    """Rows aligned by position t of some sequence (see the module docstring): `states[j]` is
    h_t, `tokens[j]` is x_{t+1}, `teacher_ids[j]` / `teacher_logprobs[j]` the base model's top-k
    for x_{t+2}; `teacher_valid[j]` is false where x_{t+1} was the sequence's final EOS;
    `sequence[j]` numbers the sequence, and rows of one sequence are consecutive."""

    states: torch.Tensor  # [M, hidden] float32
    tokens: torch.Tensor  # [M] int64
    teacher_ids: torch.Tensor  # [M, k] int64
    teacher_logprobs: torch.Tensor  # [M, k] float32
    teacher_valid: torch.Tensor  # [M] bool
    sequence: torch.Tensor  # [M] int64

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @classmethod
    def empty(cls, hidden_size: int) -> SpeculatorData:
        return cls(
            torch.zeros(0, hidden_size),
            torch.zeros(0, dtype=torch.int64),
            torch.zeros(0, TEACHER_TOP_K, dtype=torch.int64),
            torch.zeros(0, TEACHER_TOP_K),
            torch.zeros(0, dtype=torch.bool),
            torch.zeros(0, dtype=torch.int64),
        )

    @classmethod
    def cat(cls, parts: Sequence[SpeculatorData], hidden_size: int) -> SpeculatorData:
        """Concatenate, renumbering sequences so that they stay distinct."""
        if not parts:
            return cls.empty(hidden_size)
        sequences, offset = [], 0
        for part in parts:
            sequences.append(part.sequence + offset)
            offset += int(part.sequence.max()) + 1 if len(part) else 0
        joined = {f.name: torch.cat([getattr(p, f.name) for p in parts]) for f in fields(cls)}
        joined["sequence"] = torch.cat(sequences)
        return cls(**joined)

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        save_file({f.name: getattr(self, f.name).contiguous() for f in fields(self)}, str(tmp))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> SpeculatorData:
        tensors = load_file(str(path))
        return cls(**{f.name: tensors[f.name] for f in fields(cls)})

    def trainable_rows(self) -> torch.Tensor:
        """[R] int64: rows whose first head has a target."""
        return torch.nonzero(self.teacher_valid).flatten()

    def vocabulary(self, top_k: int) -> torch.Tensor:
        """[C] int64, sorted: every token among the teacher's top `top_k` at some row."""
        return torch.unique(self.teacher_ids[:, :top_k])

    def top_counts(self, vocab_size: int, top_k: int) -> torch.Tensor:
        """[vocab_size] int64: at how many valid rows each token is among the teacher's top
        `top_k`."""
        ids = self.teacher_ids[self.teacher_valid, :top_k].flatten()
        return torch.bincount(ids, minlength=vocab_size)

    def batch(self, rows: torch.Tensor, n_predict: int, top_k: int) -> Batch:
        """The batch of positions `rows` [N]: head i reads row `r + i`'s token and is taught row
        `r + i`'s teacher, when that row belongs to the same sequence."""
        last = len(self) - 1
        ahead = rows[None, :] + torch.arange(n_predict + 1)[:, None]  # [n + 1, N]
        clamped = ahead.clamp(max=last)
        same = (ahead <= last) & (self.sequence[clamped] == self.sequence[rows][None, :])
        heads = clamped[:n_predict]  # [n, N]
        return Batch(
            states=self.states[rows].float(),
            token_ids=self.tokens[clamped].t().contiguous(),
            target_ids=self.teacher_ids[heads][..., :top_k],
            target_logprobs=self.teacher_logprobs[heads][..., :top_k].float(),
            mask=same[:n_predict] & self.teacher_valid[heads],
        )


@dataclass(frozen=True)
class Answer:
    """A generated answer: its token ids, finish reason and the states of the steps that
    sampled them (`states` row n drew `token_ids[n]`)."""

    token_ids: list[int]
    finish_reason: str
    states: StepStates | None

    def rows(self, sequence: int) -> SpeculatorData | None:
        """Rows for the answer's tokens but the last (whose teacher no step computed), numbered
        `sequence`; None for answers of fewer than two tokens."""
        n = len(self.token_ids) - 1
        if n < 1 or self.states is None:
            return None
        st = self.states
        return SpeculatorData(
            states=st.hidden_states[:n].contiguous(),
            tokens=torch.tensor(self.token_ids[:n], dtype=torch.int64),
            teacher_ids=st.top_ids[1 : n + 1].contiguous(),
            teacher_logprobs=st.top_logprobs[1 : n + 1].contiguous(),
            teacher_valid=torch.ones(n, dtype=torch.bool),
            sequence=torch.full((n,), sequence, dtype=torch.int64),
        )


class DataBuilder:
    """Makes (or loads from `cache_dir`) speculator data with one engine instance, created on
    first use: `LLM(base_path, dtype=dtype, device=device)`."""

    def __init__(
        self,
        base_path: Path,
        cache_dir: Path,
        *,
        device: str = "cpu",
        dtype: str | None = None,
        settings: AnswerSettings = AnswerSettings(),
        progress: Callable[[str], None] = print,
    ) -> None:
        self.base_path = Path(base_path)
        self.cache_dir = Path(cache_dir)
        self.device = device
        self.dtype = dtype
        self.settings = settings
        self.progress = progress
        config_text = (self.base_path / "config.json").read_text()
        self.hidden_size = int(json.loads(config_text)["hidden_size"])
        self._identity = {
            "version": _FORMAT_VERSION,
            "base": str(self.base_path.resolve()),
            "config": config_text,
            "teacher_top_k": TEACHER_TOP_K,
            "dtype": dtype,
        }
        self._llm: LLM | None = None

    @property
    def llm(self) -> LLM:
        if self._llm is None:
            s = self.settings
            started = time.perf_counter()
            self._llm = LLM(
                self.base_path,
                dtype=self.dtype,
                device=self.device,
                max_num_tokens=max(8192, s.batch_size * (s.max_new_tokens + 512)),
                max_num_seqs=s.batch_size,
            )
            self.progress(f"loaded {self.base_path.name} in {time.perf_counter() - started:.0f}s")
        return self._llm

    def close(self) -> None:
        """Drop the engine (its model and KV cache)."""
        self._llm = None

    def answers(self, prompts: Sequence[str]) -> SpeculatorData:
        """Stage-2 data for `prompts`: a shard per `chunk_size` prompts, cached. The prompts of
        every missing shard go through the engine together, so that continuous batching keeps
        `batch_size` answers decoding until the last few; each shard is saved once its answers
        are all done."""
        s = self.settings
        chunks = [prompts[i : i + s.chunk_size] for i in range(0, len(prompts), s.chunk_size)]
        paths = [
            self.cache_dir / f"answers-{i:04d}-{self._key('answers', i, list(c), asdict(s))}"
            ".safetensors"
            for i, c in enumerate(chunks)
        ]
        missing = {i: list(chunks[i]) for i, path in enumerate(paths) if not path.is_file()}
        if missing:
            self._make_answers(missing, paths)
        return SpeculatorData.cat([SpeculatorData.load(p) for p in paths], self.hidden_size)

    def text(
        self, texts: Sequence[str], window: int = 256, chunk_windows: int = 64
    ) -> SpeculatorData:
        """Stage-1 data: the documents tokenized and cut into windows of `window` tokens."""
        if not texts:
            return SpeculatorData.empty(self.hidden_size)
        tokenizer = self.llm.tokenizer
        windows: list[list[int]] = []
        for text in texts:
            ids = [int(t) for t in tokenizer(text)["input_ids"]]
            windows += [ids[i : i + window] for i in range(0, len(ids), window)]
        windows = [w for w in windows if len(w) >= 8]
        parts = []
        for start in range(0, len(windows), chunk_windows):
            chunk = windows[start : start + chunk_windows]
            key = self._key("text", start, chunk)
            path = self.cache_dir / f"text-{start // chunk_windows:04d}-{key}.safetensors"
            if not path.is_file():
                started = time.perf_counter()
                data = self.collect(chunk, [0] * len(chunk), [False] * len(chunk))
                self._save(data, path)
                self.progress(
                    f"text shard {start // chunk_windows}: {len(data)} positions in "
                    f"{time.perf_counter() - started:.0f}s"
                )
            parts.append(SpeculatorData.load(path))
        return SpeculatorData.cat(parts, self.hidden_size)

    def _key(self, *parts: object) -> str:
        blob = json.dumps([self._identity, *parts], sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def _save(self, data: SpeculatorData, path: Path) -> None:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        data.save(path)

    def _make_answers(self, chunks: dict[int, list[str]], paths: Sequence[Path]) -> None:
        """Answer the prompts of `chunks` (shard index -> prompts) and save each shard's rows to
        `paths[index]` (with a JSONL of its answers) as soon as its last answer is done."""
        s = self.settings
        started = time.perf_counter()
        tokenizer = self.llm.tokenizer
        sampled: dict[int, list[bool]] = {}
        requests: list[tuple[str, list[int], bool, int]] = []
        for index, prompts in chunks.items():
            seed = s.seed * 1_000_003 + index
            rng = torch.Generator().manual_seed(seed)
            prompt_ids = chat_prompt_ids(tokenizer, prompts)
            sampled[index] = (torch.rand(len(prompts), generator=rng) < s.sampled_fraction).tolist()
            for k, (one, how) in enumerate(zip(prompt_ids, sampled[index], strict=True)):
                requests.append((f"{index}-{k}", one, how, seed + k))
        done: dict[int, dict[int, Answer]] = {index: {} for index in chunks}
        num_tokens = 0
        for request_id, answer in self.generate(requests):
            index, k = (int(part) for part in request_id.split("-"))
            done[index][k] = answer
            num_tokens += len(answer.token_ids)
            if len(done[index]) < len(chunks[index]):
                continue
            finished = done.pop(index)
            shard = [finished[k] for k in range(len(chunks[index]))]
            parts = [a.rows(k) for k, a in enumerate(shard)]
            data = SpeculatorData.cat([p for p in parts if p is not None], self.hidden_size)
            self._save(data, paths[index])
            with paths[index].with_suffix(".jsonl").open("w") as f:
                for prompt, answer, how in zip(chunks[index], shard, sampled[index], strict=True):
                    record = {
                        "prompt": prompt,
                        "answer": tokenizer.decode(answer.token_ids, skip_special_tokens=True),
                        "sampled": how,
                        "finish_reason": answer.finish_reason,
                        "num_tokens": len(answer.token_ids),
                    }
                    f.write(json.dumps(record) + "\n")
            seconds = time.perf_counter() - started
            self.progress(
                f"answers shard {index}: {len(data)} positions; {num_tokens} tokens in "
                f"{seconds:.0f}s ({num_tokens / max(seconds, 1e-9):.0f} tok/s)"
            )

    def generate(
        self, requests: Sequence[tuple[str, list[int], bool, int]]
    ) -> Iterator[tuple[str, Answer]]:
        """Answer every `(request_id, prompt_ids, sampled, seed)` through the engine's continuous
        batching: greedy, or sampling seeded with `seed` where `sampled`, recording the states
        and teachers of every step. Yields each answer when it is finished."""
        s = self.settings
        engine = self.llm.engine
        greedy = SamplingParams(max_new_tokens=s.max_new_tokens)
        tokens: dict[str, list[int]] = {}
        for request_id, prompt, how, seed in requests:
            params = greedy
            if how:
                params = SamplingParams(
                    max_new_tokens=s.max_new_tokens,
                    temperature=s.temperature,
                    top_k=s.top_k,
                    seed=seed,
                )
            tokens[request_id] = []
            engine.add_request(request_id, list(prompt), params)
        recorder = StateRecorder(TEACHER_TOP_K)
        engine.observers.append(recorder)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step().outputs:
                    tokens[out.request_id] += out.new_token_ids
                    if out.finish_reason is not None:
                        answer = Answer(
                            tokens.pop(out.request_id),
                            out.finish_reason.value,
                            recorder.pop(out.request_id),
                        )
                        yield out.request_id, answer
        finally:
            engine.observers.remove(recorder)

    @torch.inference_mode()
    def collect(
        self,
        sequences: Sequence[Sequence[int]],
        firsts: Sequence[int],
        eos_ended: Sequence[bool],
        max_tokens_per_pass: int = 2048,
    ) -> SpeculatorData:
        """Rows for positions `firsts[s]` .. len - 2 of each sequence, from prefill passes of the
        engine's ModelRunner (its KV blocks taken from, and given back to, the idle engine's pool).
        """
        llm = self.llm
        if llm.engine.has_unfinished_requests():
            raise RuntimeError("the engine must be idle while collecting hidden states")
        runner, kv = llm.runner, llm.engine.kv
        parts: list[SpeculatorData] = []
        group: list[int] = []
        order = [s for s in range(len(sequences)) if len(sequences[s]) - firsts[s] >= 2]

        def flush() -> None:
            inputs = []
            for s in group:
                seq = list(sequences[s])
                if not kv.allocate_slots(("collect", s), len(seq)):
                    raise RuntimeError(f"KV pool too small for a {len(seq)}-token sequence")
                inputs.append(
                    SequenceInput(
                        token_ids=seq,
                        num_computed_tokens=0,
                        block_table=kv.block_table(("collect", s)),
                        logits_indices=list(range(firsts[s], len(seq))),
                    )
                )
            try:
                out = runner.execute(inputs)
            finally:
                for s in group:
                    kv.free(("collect", s))
            row = 0
            for s, n in zip(group, out.num_rows, strict=True):
                hidden = out.hidden_states[row : row + n].float().cpu()
                logits = out.logits[row + 1 : row + n]
                top, top_ids = logits.topk(TEACHER_TOP_K, dim=-1)
                top_logprobs = (top - logits.logsumexp(-1, keepdim=True)).cpu()
                valid = torch.ones(n - 1, dtype=torch.bool)
                if eos_ended[s]:
                    valid[-1] = False
                parts.append(
                    SpeculatorData(
                        states=hidden[:-1].contiguous(),
                        tokens=torch.tensor(sequences[s][firsts[s] + 1 :], dtype=torch.int64),
                        teacher_ids=top_ids.cpu(),
                        teacher_logprobs=top_logprobs.float(),
                        teacher_valid=valid,
                        sequence=torch.full((n - 1,), s, dtype=torch.int64),
                    )
                )
                row += n
            group.clear()

        size = 0
        for s in order:
            if group and size + len(sequences[s]) > max_tokens_per_pass:
                flush()
                size = 0
            group.append(s)
            size += len(sequences[s])
        if group:
            flush()
        return SpeculatorData.cat(parts, self.hidden_size)
