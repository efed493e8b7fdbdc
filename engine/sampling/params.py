"""Per-request decoding parameters, as the engine sees them (no protobuf here)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """Greedy when `temperature` is 0; otherwise seeded sampling with top-k / top-p / typical-p
    filtering. `repetition_penalty` (HF-style, over prompt + output) applies to both;
    `length_penalty` (start_index, decay_factor) raises the EOS score after start_index generated
    tokens. `logprobs` asks for each token's logprob and rank, plus `top_n_tokens` candidates.

    OpenAI's additive rules (`additive_penalties`) apply to both as well: `logit_bias` adds its
    bias to a token's logit; `presence_penalty` and `frequency_penalty` subtract
    presence_penalty * [count > 0] + frequency_penalty * count, where count is how often the
    token occurs among the generated tokens (the prompt is not counted). They apply after the
    EOS rules and before the repetition penalty, which scales the adjusted logits. `logit_bias`
    is copied on construction and read only; its ids must be in the model's vocabulary
    (`check_token_ids`, which the engine calls when it queues a request)."""

    max_new_tokens: int = 64
    min_new_tokens: int = 0
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filtering
    top_p: float = 1.0  # 1.0: no nucleus filtering
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()  # stop on any of these (from min_new_tokens on)
    typical_p: float = 1.0  # 1.0: no typical filtering
    repetition_penalty: float = 1.0  # 1.0: none
    length_penalty: tuple[int, float] | None = None  # (start_index, decay_factor)
    logprobs: bool = False
    prompt_logprobs: bool = False  # details of the prompt tokens too (see EngineOutput)
    top_n_tokens: int = 0
    presence_penalty: float = 0.0  # OpenAI's, -2..2
    frequency_penalty: float = 0.0  # OpenAI's, -2..2
    logit_bias: dict[int, float] | None = field(default=None, hash=False)  # token id -> bias

    def __post_init__(self) -> None:
        """ValueError on any value the logit rules cannot apply, non-finite floats included."""
        for name in ("temperature", "top_p", "typical_p", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite")
        if self.length_penalty is not None and not (
            math.isfinite(self.length_penalty[1]) and self.length_penalty[1] > 0
        ):
            raise ValueError("length_penalty decay_factor must be finite and positive")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be non-negative")
        if self.top_k < 0:
            raise ValueError("top_k must be non-negative")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if not 0 < self.typical_p <= 1:
            raise ValueError("typical_p must be in (0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be positive")
        if self.top_n_tokens < 0:
            raise ValueError("top_n_tokens must be non-negative")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_ADDITIVE_PENALTY <= getattr(self, name) <= MAX_ADDITIVE_PENALTY:
                value = getattr(self, name)
                raise ValueError(f"{name} must be between -2.0 and 2.0, got {value}")
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _checked_bias(self.logit_bias))

    @property
    def has_additive_rules(self) -> bool:
        """Whether `logit_bias`, `presence_penalty` or `frequency_penalty` changes a logit."""
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0

    def check_token_ids(self, vocab_size: int) -> None:
        """ValueError when a `logit_bias` token id is outside the model's vocabulary."""
        for token_id in self.logit_bias or ():
            if token_id >= vocab_size:
                raise ValueError(
                    f"logit_bias token id {token_id} is outside the vocabulary "
                    f"(0 to {vocab_size - 1})"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


MAX_ADDITIVE_PENALTY = 2.0
"""The bound on the magnitude of `presence_penalty` and `frequency_penalty` (OpenAI's)."""
MAX_LOGIT_BIAS = 100.0
"""The bound on the magnitude of a `logit_bias` value (OpenAI's)."""


def _checked_bias(bias: object) -> dict[int, float]:
    """A copy of `bias` with float values; ValueError naming `logit_bias` when it is not a
    mapping of non-negative int token ids to finite biases in -100..100."""
    if not isinstance(bias, dict):
        raise ValueError("logit_bias must map token ids to biases")
    checked: dict[int, float] = {}
    for token_id, value in bias.items():
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise ValueError(
                f"logit_bias keys must be token ids (non-negative ints), got {token_id!r:.40}"
            )
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"logit_bias[{token_id}] must be a number, got {value!r:.40}")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:  # NaN included
            raise ValueError(f"logit_bias[{token_id}] must be between -100 and 100, got {value}")
        checked[token_id] = float(value)
    return checked


def draw_seed(rng: random.Random | None = None, bits: int = 64) -> int:
    """A random `bits`-bit seed for a sampling request that came without one, from `rng`
    (default: Python's `random` module, so that `random.seed` repeats a run). The one function
    that draws seeds: the server calls it when it validates an input (it reports the seed, 32
    bits as TGIS does, before the engine sees the request), the engine for other callers'
    requests (`LLMEngine.add_request`)."""
    return random.getrandbits(bits) if rng is None else rng.getrandbits(bits)
