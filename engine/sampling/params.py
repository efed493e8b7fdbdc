"""Per-request decoding parameters, as the engine sees them (no protobuf here)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """Greedy when `temperature` is 0; otherwise seeded sampling with top-k / top-p / typical-p
    filtering. `repetition_penalty` (HF-style, over prompt + output) applies to both;
    `length_penalty` (start_index, decay_factor) raises the EOS score after start_index generated
    tokens. `logprobs` asks for each token's logprob and rank, plus `top_n_tokens` candidates."""

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def draw_seed(rng: random.Random | None = None, bits: int = 64) -> int:
    """A random `bits`-bit seed for a sampling request that came without one, from `rng`
    (default: Python's `random` module, so that `random.seed` repeats a run). The one function
    that draws seeds: the server calls it when it validates an input (it reports the seed, 32
    bits as TGIS does, before the engine sees the request), the engine for other callers'
    requests (`LLMEngine.add_request`)."""
    return random.getrandbits(bits) if rng is None else rng.getrandbits(bits)
