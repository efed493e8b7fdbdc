"""Built-in chat instructions for training and evaluating speculators, the chat prompts of the
tests and benchmarks, the chat-template wrapping every user of these prompts shares, and
prompt/text file readers.

The prompts are data, in `prompts.json` next to this module: ``chat`` (the tests' and
benchmarks' chat prompts), ``eval`` (the held-out evaluation prompts) and ``train_families``
(each family's templates and fillers: topic questions, how-to tasks, comparisons, writing,
coding, rewriting, definitions, translation, advice, arithmetic). No training filler is a topic,
task, pair or sentence of an evaluation prompt, so the held-out set measures generalisation to
new subjects, not recall of seen prompts.

`builtin_prompts()` is a fixed, deterministic list: the `NUM_EVAL_PROMPTS` evaluation prompts,
then every family's templates filled with each of its fillers, in a fixed shuffled order (so
any prefix of the training part mixes every family).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from functools import cache
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

NUM_EVAL_PROMPTS = 48


@cache
def _data() -> dict[str, Any]:
    """The parsed `prompts.json` (read once)."""
    data: dict[str, Any] = json.loads(
        files("training").joinpath("prompts.json").read_text(encoding="utf-8")
    )
    return data


CHAT_PROMPTS: list[str] = list(_data()["chat"])
"""Chat prompts of the tests (greedy output against transformers) and of the decode and verify
benchmarks; none of them is a built-in training or evaluation prompt."""


def _user_turn(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str]) -> list[list[int]]:
    """Token ids of each prompt as a user turn under the tokenizer's chat template (the plain
    encoding when it has none), ready for generation."""
    out = []
    for prompt in prompts:
        if tokenizer.chat_template:
            ids: Any = tokenizer.apply_chat_template(
                _user_turn(prompt), add_generation_prompt=True, return_dict=False
            )
            if not isinstance(ids, list):  # a BatchEncoding, should return_dict be ignored
                ids = ids["input_ids"]
        else:
            ids = tokenizer(prompt)["input_ids"]
        out.append([int(t) for t in ids])
    return out


def chat_texts(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str]) -> list[str]:
    """Each prompt as a user turn under the tokenizer's chat template, as text (e.g. for a gRPC
    request; the prompt itself when the tokenizer has no template)."""
    if not tokenizer.chat_template:
        return list(prompts)
    return [
        str(
            tokenizer.apply_chat_template(_user_turn(p), add_generation_prompt=True, tokenize=False)
        )
        for p in prompts
    ]


def builtin_prompts() -> list[str]:
    """Every built-in instruction: `NUM_EVAL_PROMPTS` held-out evaluation prompts first, then
    several thousand training prompts in a fixed shuffled order (so any prefix of the training
    part mixes every family). Deterministic and free of duplicates."""
    data = _data()
    evals = list(data["eval"])
    train: list[str] = []
    for family in data["train_families"]:
        for filler in family["fillers"]:
            args = filler if isinstance(filler, list) else [filler]
            train += [template.format(*args) for template in family["templates"]]
    held_out = set(evals)
    train = [p for p in dict.fromkeys(train) if p not in held_out]
    random.Random(data["train_shuffle_seed"]).shuffle(train)
    assert len(evals) == NUM_EVAL_PROMPTS, len(evals)
    return evals + train


def eval_prompts() -> list[str]:
    """The held-out evaluation prompts (never used for training)."""
    return builtin_prompts()[:NUM_EVAL_PROMPTS]


def train_prompts() -> list[str]:
    """The built-in training prompts, in their fixed order."""
    return builtin_prompts()[NUM_EVAL_PROMPTS:]


def read_prompts(paths: Sequence[str | Path]) -> list[str]:
    """Prompts from files: `.jsonl` lines are objects with a `prompt`, `instruction`, `text` or
    `messages` (a chat list whose user turns are joined) field, or JSON strings; any other file
    holds one prompt per non-empty line. Raises ValueError naming the file and line."""
    prompts: list[str] = []
    for path in map(Path, paths):
        lines = path.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if path.suffix == ".jsonl":
                prompts.append(_jsonl_text(line, path, number, ("prompt", "instruction", "text")))
            else:
                prompts.append(line.strip())
    return prompts


def read_texts(paths: Sequence[str | Path]) -> list[str]:
    """Documents from files: a `.jsonl` file holds one document per line (a JSON string or an
    object with a `text`, `content` or `prompt` field); any other file is one document."""
    texts: list[str] = []
    for path in map(Path, paths):
        content = path.read_text(encoding="utf-8")
        if path.suffix != ".jsonl":
            texts.append(content)
            continue
        for number, line in enumerate(content.splitlines(), 1):
            if line.strip():
                texts.append(_jsonl_text(line, path, number, ("text", "content", "prompt")))
    return [t for t in texts if t.strip()]


def _jsonl_text(line: str, path: Path, number: int, fields: Sequence[str]) -> str:
    try:
        value = json.loads(line)
    except ValueError as e:
        raise ValueError(f"{path}:{number}: not JSON ({e})") from e
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        for name in fields:
            if isinstance(value.get(name), str):
                return str(value[name])
        messages = value.get("messages")
        if isinstance(messages, list):
            turns = [m.get("content", "") for m in messages if isinstance(m, dict)]
            users = [
                m.get("content", "")
                for m in messages
                if isinstance(m, dict) and m.get("role") == "user"
            ]
            return "\n".join(str(t) for t in (users or turns))
    raise ValueError(f"{path}:{number}: expected a string or an object with one of {list(fields)}")
