"""Offline evaluation of a speculator: greedy tree verification on held-out prompts.

The base model answers every prompt greedily through the engine with the speculator on and the
adaptive policy off, so each step verifies the full candidate tree; each EngineOutput says how
deep the verified tree was (`draft_depth`) and how many drafts were accepted
(`num_accepted_tokens`). From those:

- tokens per step: tokens gained per verifying step (accepted drafts + the base model's own);
- head i acceptance: of the steps whose tree reached depth i + 1, the share that accepted at
  least i + 1 drafts (so head 0's rate is the share of steps gaining more than one token), and
  the same share given that the first i drafts were accepted (conditional).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from engine.llm import LLM
from engine.sampling.params import SamplingParams
from training.data import chat_prompt_ids


@dataclass
class SpeculationStats:
    """Counts from verifying steps; `reached[i]` / `accepted[i]` count steps whose tree had a
    draft at depth i + 1 / that accepted at least i + 1 drafts."""

    top_k_tokens_per_head: tuple[int, ...]
    n_candidates: int
    selection: str = "coverage"
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    num_prompts: int = 0
    num_steps: int = 0
    num_tokens: int = 0
    num_plain_steps: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    @property
    def tokens_per_step(self) -> float:
        return self.num_tokens / self.num_steps if self.num_steps else 0.0

    def acceptance(self, head: int) -> float:
        return self.accepted[head] / self.reached[head] if self.reached[head] else 0.0

    def conditional_acceptance(self, head: int) -> float:
        before = self.accepted[head - 1] if head else self.reached[head]
        return self.accepted[head] / before if before else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "tokens_per_step": self.tokens_per_step,
            "acceptance": [self.acceptance(i) for i in range(len(self.reached))],
        }

    def table(self) -> str:
        """A plain-text report."""
        decoding = "greedy"
        if self.temperature:
            decoding = f"sampled at temperature {self.temperature:g}, top-p {self.top_p:g}"
        lines = [
            f"tree top-k {list(self.top_k_tokens_per_head)} x {self.n_candidates} candidates "
            f"({self.selection}), {decoding}, {self.num_prompts} prompts, "
            f"{self.generated_tokens} tokens in {self.seconds:.0f}s",
            f"mean tokens per step: {self.tokens_per_step:.3f} "
            f"({self.num_tokens} tokens in {self.num_steps} verifying steps)",
            "head  reached  accepted  acceptance  conditional",
        ]
        for i in range(len(self.reached)):
            lines.append(
                f"{i:>4}  {self.reached[i]:>7}  {self.accepted[i]:>8}  "
                f"{self.acceptance(i):>10.3f}  {self.conditional_acceptance(i):>11.3f}"
            )
        return "\n".join(lines)


def evaluate_speculator(
    base_path: str | Path,
    speculator_path: str | Path,
    prompts: Sequence[str],
    *,
    max_new_tokens: int = 128,
    top_k_tokens_per_head: Sequence[int] | None = None,
    n_candidates: int | None = None,
    candidate_selection: str = "coverage",
    batch_size: int = 16,
    dtype: str | None = None,
    device: str = "cpu",
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
) -> SpeculationStats:
    """Answer `prompts` (as chat user turns) with the speculator at `speculator_path` verifying
    its full tree every step (the config's tree unless overridden), `batch_size` requests at a
    time, and count what the trees gained: greedily, or sampled at `temperature` and `top_p`
    (prompt k with seed `seed + k`)."""
    llm = LLM(
        base_path,
        dtype=dtype,
        device=device,
        max_num_tokens=max(8192, batch_size * (max_new_tokens + 512)),
        max_num_seqs=batch_size,
        speculator=speculator_path,
        top_k_tokens_per_head=top_k_tokens_per_head,
        n_candidates=n_candidates,
        candidate_selection=candidate_selection,
        spec_max_batch_size=batch_size,
        adaptive_speculation=False,
    )
    assert llm.engine.drafter is not None
    proposer = llm.engine.drafter.proposer
    stats = SpeculationStats(
        top_k_tokens_per_head=tuple(getattr(proposer, "top_k_tokens_per_head", ())),
        n_candidates=proposer.num_candidates,
        selection=candidate_selection,
        temperature=temperature,
        top_p=top_p,
        num_prompts=len(prompts),
        reached=[0] * proposer.num_heads,
        accepted=[0] * proposer.num_heads,
    )
    engine = llm.engine
    started = time.perf_counter()
    for k, ids in enumerate(chat_prompt_ids(llm.tokenizer, prompts)):
        params = SamplingParams(
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed + k
        )
        engine.add_request(f"eval-{k}", ids, params)
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            stats.generated_tokens += len(out.new_token_ids)
            if not out.draft_depth:
                stats.num_plain_steps += bool(out.new_token_ids)
                continue
            stats.num_steps += 1
            stats.num_tokens += len(out.new_token_ids)
            for i in range(out.draft_depth):
                stats.reached[i] += 1
                stats.accepted[i] += out.num_accepted_tokens > i
    stats.seconds = time.perf_counter() - started
    return stats
