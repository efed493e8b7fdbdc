"""Offline API: `LLM(model_path).generate(prompts, max_new_tokens=...)`, one paged batch."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.kv_cache import KVCacheManager
from engine.model_runner import ModelRunner, SequenceInput
from engine.paths import default_model_path
from engine.sampler import make_generator, sample
from engine.sampling_params import SamplingParams


@dataclass
class GenerationOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids, ending with EOS when EOS stopped it
    text: str
    finish_reason: str  # "eos" or "length"
    logits: list[torch.Tensor] = field(default_factory=list, repr=False)  # [vocab] per token


@dataclass
class _Seq:
    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    finish_reason: str | None = None
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


class LLM:
    """Loads a model once and generates for batches of prompts through the paged KV cache."""

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        dtype: str | torch.dtype | None = None,
        device: str = "cpu",
        block_size: int | None = None,
        max_num_tokens: int = 65536,
    ) -> None:
        """`max_num_tokens` sizes the KV pool (prompt + generated tokens over all sequences)."""
        path = Path(model_path) if model_path is not None else default_model_path()
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(path))
        probe_block = block_size or (256 if device.startswith("cuda") else 16)
        self.runner = ModelRunner(
            path,
            num_blocks=math.ceil(max_num_tokens / probe_block) + 1,
            dtype=dtype,
            device=device,
            block_size=block_size,
        )
        self.kv = KVCacheManager(self.runner.num_blocks, self.runner.block_size)
        self.eos_token_ids = set(self.runner.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        max_new_tokens: int = 64,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        ignore_eos: bool = False,
        return_logits: bool = False,
    ) -> list[GenerationOutput]:
        """Generate for every prompt in one batch: one prefill step over all prompts, then one
        decode step per token for the unfinished ones. Greedy unless `temperature` > 0."""
        params = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            ignore_eos=ignore_eos,
        )
        seqs = [
            _Seq(i, self._encode(p), params, make_generator(params)) for i, p in enumerate(prompts)
        ]
        running = [s for s in seqs if s.prompt_token_ids]
        if len(running) != len(seqs):
            raise ValueError("empty prompt")
        try:
            while running:
                self._step(running, return_logits)
                for s in running:
                    if s.finish_reason is not None:
                        self.kv.free(s.seq_id)
                running = [s for s in running if s.finish_reason is None]
        finally:
            for s in seqs:
                if self.kv.has(s.seq_id):
                    self.kv.free(s.seq_id)
        return [
            GenerationOutput(
                prompt_token_ids=s.prompt_token_ids,
                token_ids=s.output_token_ids,
                text=str(self.tokenizer.decode(s.output_token_ids, skip_special_tokens=True)),
                finish_reason=s.finish_reason or "length",
                logits=s.logits,
            )
            for s in seqs
        ]

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        return [int(t) for t in prompt]

    def _step(self, running: list[_Seq], return_logits: bool) -> None:
        inputs = []
        for s in running:
            token_ids = s.token_ids[s.num_computed_tokens :]
            if not self.kv.allocate_slots(s.seq_id, s.num_computed_tokens + len(token_ids)):
                raise RuntimeError("KV cache is full: raise max_num_tokens")
            inputs.append(
                SequenceInput(token_ids, s.num_computed_tokens, self.kv.block_table(s.seq_id))
            )
        out = self.runner.execute(inputs)
        new_ids = sample(out.logits, [s.params for s in running], [s.generator for s in running])
        for i, (s, inp) in enumerate(zip(running, inputs, strict=True)):
            s.num_computed_tokens += len(inp.token_ids)
            token = new_ids[i]
            s.output_token_ids.append(token)
            if return_logits:
                s.logits.append(out.logits[i].clone())
            if token in self.eos_token_ids and not s.params.ignore_eos:
                s.finish_reason = "eos"
            elif len(s.output_token_ids) >= s.params.max_new_tokens:
                s.finish_reason = "length"
