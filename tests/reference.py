"""transformers as the oracle: greedy generation with per-step logits, and the near-tie rule;
`TreeRows`, an observer that proves speculation ran."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from engine.spec_decode.mlp_speculator import MLPSpeculator
from engine.spec_decode.speculator_config import MLPSpeculatorConfig
from training import prompts
from training.prompts import CHAT_PROMPTS

NEAR_TIE = 1e-4
PROMPT_LOGITS_ATOL = 1e-4  # the prompt's last position
DECODE_LOGITS_ATOL = 1e-3  # later steps: fp32 rounding accumulates through the KV cache


def require_model(path: Path) -> Path:
    """`path`, a model folder `make models` prepares; fails the test when it is missing."""
    if not (path / "config.json").is_file():
        pytest.fail(f"{path} is missing: run `make models` first")
    return path


@cache
def hf_model(path: Path) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.eval()


@cache
def chat_prompt_ids(path: Path) -> tuple[tuple[int, ...], ...]:
    """CHAT_PROMPTS as token ids under the chat template of the model at `path`."""
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return tuple(tuple(ids) for ids in prompts.chat_prompt_ids(tokenizer, CHAT_PROMPTS))


@dataclass(frozen=True)
class Reference:
    token_ids: list[int]
    logits: list[torch.Tensor]  # [vocab] per generated token


@cache
def hf_greedy(
    path: Path, prompt_ids: tuple[int, ...], max_new_tokens: int, min_new_tokens: int = 0
) -> Reference:
    return model_greedy(hf_model(path), prompt_ids, max_new_tokens, min_new_tokens)


def model_greedy(
    model: PreTrainedModel, prompt_ids: Sequence[int], max_new_tokens: int, min_new_tokens: int = 0
) -> Reference:
    """transformers' greedy `generate` of `model` on one prompt: tokens and float32 logits (before
    `min_new_tokens` masks EOS)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([list(prompt_ids)]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=model.generation_config.eos_token_id,
        )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    return Reference(tokens, [step[0].float() for step in out.logits])


def compare_greedy(
    ours: list[int], ref: Reference, our_logits: list[torch.Tensor] | None = None
) -> bool:
    """Assert `ours` equals the reference, except after a true near-tie; return True at one.

    At the first differing position the reference's top-2 logits must differ by less than
    NEAR_TIE. Logits, when given, must match up to that position: within 1e-4 for the prompt's
    last position, 1e-3 after it.
    """
    n = min(len(ours), len(ref.token_ids))
    first_diff = next((i for i in range(n) if ours[i] != ref.token_ids[i]), None)
    checked = first_diff + 1 if first_diff is not None else n
    if our_logits is not None:
        for i in range(checked):
            err = (our_logits[i] - ref.logits[i]).abs().max().item()
            tolerance = PROMPT_LOGITS_ATOL if i == 0 else DECODE_LOGITS_ATOL
            assert err < tolerance, f"logits at step {i} differ by {err}"
    if first_diff is None:
        assert len(ours) == len(ref.token_ids), (
            f"lengths differ: {len(ours)} vs {len(ref.token_ids)}"
        )
        return False
    top2 = ref.logits[first_diff].topk(2)
    gap = (top2.values[0] - top2.values[1]).item()
    assert ours[first_diff] in top2.indices.tolist(), f"token {first_diff} is not in the top 2"
    assert gap < NEAR_TIE, (
        f"token {first_diff} differs ({ours[first_diff]} vs {ref.token_ids[first_diff]}) "
        f"and the reference's top-2 gap {gap:.2e} is no near-tie"
    )
    return True


def hf_greedy_with_prefix(
    path: Path, prefix: torch.Tensor, prompt_ids: list[int], max_new_tokens: int
) -> Reference:
    """Greedy transformers output for `inputs_embeds` = `prefix` ([virtual tokens, hidden])
    followed by the embeddings of `prompt_ids` (generate then returns the new tokens only)."""
    model = hf_model(path)
    with torch.no_grad():
        prompt = model.get_input_embeddings()(torch.tensor([prompt_ids]))
        embeds = torch.cat([prefix.float()[None], prompt], dim=1)  # [1, P + n, hidden]
        out = model.generate(
            inputs_embeds=embeds,
            attention_mask=torch.ones(embeds.shape[:2], dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=model.generation_config.eos_token_id,
        )
    return Reference(out.sequences[0].tolist(), [step[0].float() for step in out.logits])


class TreeRows:
    """Counts the logits rows of verified draft trees (an engine observer)."""

    def __init__(self) -> None:
        self.count = 0

    def on_logits(
        self,
        request_ids: Sequence[str],
        logits: torch.Tensor,
        hidden_states: torch.Tensor,
        from_tree: bool,
    ) -> None:
        self.count += len(request_ids) if from_tree else 0


def random_speculator(
    vocab_size: int,
    n_predict: int = 3,
    tie: bool = False,
    scale: bool = False,
    seed: int = 0,
    emb_dim: int = 24,
    inner_dim: int = 16,
) -> MLPSpeculator:
    """A small MLP speculator with fms's initialisation from `seed`, its norms' weights and
    biases perturbed (so they matter)."""
    config = MLPSpeculatorConfig(
        vocab_size=vocab_size, emb_dim=emb_dim, inner_dim=inner_dim, n_predict=n_predict,
        tie_weights=tie, scale_input=scale,
    )  # fmt: skip
    model = MLPSpeculator(config)
    generator = torch.Generator().manual_seed(seed)
    model.reset_parameters(generator)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("ln."):
                p.add_(torch.randn(p.shape, generator=generator) * 0.2)
    return model
