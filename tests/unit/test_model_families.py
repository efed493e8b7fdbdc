"""The model families `engine.models.config` supports, on tiny random checkpoints written by
transformers' own classes (tests/families.py): greedy tokens through the offline engine equal
transformers' `generate`, with and without a random speculator drafting from the final hidden
states; what config.json says is read as its family's knobs, and what the engine cannot serve
is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, model_runner
from engine.attention import TorchAttentionBackend
from engine.kernels.autotune import KernelTable
from engine.models.config import LlamaConfig
from engine.models.llama import LlamaModel
from tests.families import (
    GRANITE_MULTIPLIERS,
    MAX_NEW_TOKENS,
    MAX_POSITIONS,
    SLIDING_WINDOW,
    VARIANTS,
    checkpoint,
    retype,
)
from tests.reference import TreeRows, chat_prompt_ids, compare_greedy, hf_greedy
from tools.tiny_speculator import write_tiny_speculator

NUM_PROMPTS = 2
BASE = {
    "vocab_size": 32, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "max_position_embeddings": 512,
}  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints() -> dict[str, Path]:
    return {variant: checkpoint(variant) for variant in VARIANTS}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_transformers_with_and_without_speculator(
    checkpoints: dict[str, Path], tmp_path: Path, variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kernel selection by measurement is skipped (each Linear keeps its default kernels, and
    tests/unit/test_linear.py checks every kernel exact); the server test runs it."""
    monkeypatch.setattr(model_runner, "choose_kernels", lambda linears, mode: KernelTable())
    path = checkpoints[variant]
    prompts = [list(p) for p in chat_prompt_ids(path)[:NUM_PROMPTS]]
    refs = [hf_greedy(path, tuple(p), MAX_NEW_TOKENS) for p in prompts]
    speculator = write_tiny_speculator(tmp_path / "speculator", path, n_predict=3)
    for spec in (None, speculator):
        llm = LLM(path, speculator=spec, adaptive_speculation=False)
        tree_rows = TreeRows()
        llm.engine.observers.append(tree_rows)
        outputs = llm.generate(prompts, MAX_NEW_TOKENS, return_logits=True)
        for out, ref in zip(outputs, refs, strict=True):
            compare_greedy(out.token_ids, ref, out.logits)
        assert (tree_rows.count > 0) == (spec is not None)
        max_model_len = SLIDING_WINDOW if variant == "mistral" else MAX_POSITIONS
        assert llm.engine.scheduler.max_model_len == max_model_len


def test_knobs_are_read_by_family(checkpoints: dict[str, Path]) -> None:
    llama = LlamaConfig.from_folder(checkpoints["llama"])
    assert (llama.model_type, llama.qkv_bias, llama.o_proj_bias) == ("llama", True, True)
    assert (llama.attention_multiplier, llama.sliding_window) == (None, None)
    for variant in ("granite", "granite-untied"):
        granite = LlamaConfig.from_folder(checkpoints[variant])
        assert granite.model_type == "granite"
        assert {k: getattr(granite, k) for k in GRANITE_MULTIPLIERS} == GRANITE_MULTIPLIERS
    mistral = LlamaConfig.from_folder(checkpoints["mistral"])
    assert (mistral.model_type, mistral.sliding_window, mistral.qkv_bias) == (
        "mistral",
        SLIDING_WINDOW,
        False,
    )
    qwen2 = LlamaConfig.from_folder(checkpoints["qwen2"])
    assert (qwen2.qkv_bias, qwen2.o_proj_bias, qwen2.sliding_window) == (True, False, None)
    assert qwen2.tie_word_embeddings


def test_neutral_llama_folds_nothing() -> None:
    """A Llama loads every tensor unscaled and embeds without a multiplication."""
    config = LlamaConfig.from_dict({**BASE, "model_type": "llama", "tie_word_embeddings": True})
    model = LlamaModel(config, TorchAttentionBackend(), torch.float32, torch.device("cpu"))
    assert model.embed_scale is None
    assert {t.scale for t in model.weight_targets().values()} == {1.0}


@pytest.mark.parametrize(
    ("requested", "expected"), [(None, SLIDING_WINDOW), (4096, SLIDING_WINDOW), (100, 100)]
)
def test_sliding_window_caps_max_model_len(requested: int | None, expected: int) -> None:
    """The engine serves no request longer than the window (see also the mistral checkpoint's
    `scheduler.max_model_len` above, and the server's max_sequence_length in
    tests/server/test_model_families_server.py)."""
    config = LlamaConfig.from_dict(
        {**BASE, "model_type": "mistral", "sliding_window": SLIDING_WINDOW}
    )
    assert config.max_model_len(requested) == expected
    assert LlamaConfig.from_dict({**BASE, "model_type": "mistral"}).max_model_len(4096) == 4096


@pytest.mark.parametrize(
    ("extra", "window"),
    [
        ({"sliding_window": 64}, None),
        ({"sliding_window": 64, "use_sliding_window": True}, 64),
        (
            {
                "sliding_window": 64,
                "use_sliding_window": True,
                "layer_types": ["full_attention", "full_attention"],
            },
            None,
        ),
        (
            {
                "sliding_window": 64,
                "use_sliding_window": True,
                "layer_types": ["full_attention", "sliding_attention"],
            },
            64,
        ),
    ],
)
def test_qwen2_window_counts_only_where_a_layer_slides(extra: dict, window: int | None) -> None:
    config = LlamaConfig.from_dict({**BASE, "model_type": "qwen2", **extra})
    assert config.sliding_window == window


def test_unsupported_model_type_is_refused(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    folder = retype(checkpoints["llama"], tmp_path / "gpt2", "gpt2")
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported") as info:
        LlamaConfig.from_folder(folder)
    assert "llama, granite, mistral, qwen2" in str(info.value)


def test_granite_multipliers_under_another_model_type_are_refused(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    folder = retype(checkpoints["granite"], tmp_path / "granite-as-llama", "llama")
    with pytest.raises(ValueError, match="set model_type to 'granite'") as info:
        LlamaConfig.from_folder(folder)
    assert all(key in str(info.value) for key in GRANITE_MULTIPLIERS)
    with pytest.raises(ValueError, match="residual_multiplier"):
        LlamaConfig.from_dict({**BASE, "model_type": "mistral", "residual_multiplier": 0.5})
