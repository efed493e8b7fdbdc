"""Offline API: `LLM(model_path).generate(prompts, max_new_tokens=...)`, one paged batch."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from engine.builder import build_engine, load_tokenizer
from engine.config import EngineConfig, SpeculativeConfig
from engine.hooks import LogitsRecorder
from engine.paths import default_model_path
from engine.request import PromptPrefix
from engine.sampling.params import SamplingParams
from engine.spec_decode.proposer import Proposer


@dataclass
class GenerationOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids, ending with EOS when EOS stopped it
    text: str
    finish_reason: str  # a FinishReason value: "EOS_TOKEN", "MAX_TOKENS", ...
    logits: list[torch.Tensor] = field(default_factory=list, repr=False)  # [vocab] per token


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
        max_num_seqs: int = 256,
        speculator: str | Path | Proposer | None = None,
        top_k_tokens_per_head: Sequence[int] | None = None,
        n_candidates: int | None = None,
        candidate_selection: str = "nodes",
        spec_max_batch_size: int = 16,
        adaptive_speculation: bool = True,
        enable_prefix_caching: bool = True,
        cpu_kernels: bool = True,
        cuda_graphs: bool = True,
        tensor_parallel_size: int = 1,
        master_port: int = 29500,
        quantize: str | None = None,
    ) -> None:
        """`max_num_tokens` sizes the KV pool (prompt + generated tokens over all sequences) and
        the per-step token budget; `max_num_seqs` bounds the running batch. `speculator` (an
        MLP speculator's path, or any Proposer) turns on speculative decoding for greedy and
        sampled requests while at most `spec_max_batch_size` run; `top_k_tokens_per_head` and
        `n_candidates` override the speculator config's tree shape, and `candidate_selection` picks
        the candidates ("nodes", "coverage" or fms-extras' "joint", see `MLPProposer`). With
        `adaptive_speculation`, a SpeculationPolicy picks per step how many candidates pay.
        `enable_prefix_caching` shares the KV blocks of identical prompt prefixes.
        `cpu_kernels=False` runs the CPU float32 glue and attention as ATen ops instead of the
        fused C kernels. `cuda_graphs=False` runs every CUDA step eagerly.
        `tensor_parallel_size` N > 1 splits the model over N processes (this one is rank 0;
        they meet on localhost:`master_port`); `close` (or leaving a `with` block) stops them.
        `quantize` ("gptq", "int8"; None: what the checkpoint declares) quantizes the decoder
        layers' weights (`engine.quant.scheme`)."""
        path = Path(model_path) if model_path is not None else default_model_path()
        self.tokenizer: PreTrainedTokenizerBase = load_tokenizer(path)
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
        speculative = SpeculativeConfig(
            path=Path(speculator) if isinstance(speculator, str | Path) else None,
            top_k_tokens_per_head=tuple(top_k_tokens_per_head) if top_k_tokens_per_head else None,
            n_candidates=n_candidates,
            candidate_selection=candidate_selection,
            max_batch_size=spec_max_batch_size,
            adaptive=adaptive_speculation,
        )
        config = EngineConfig(
            model_path=path,
            dtype=dtype,
            device=device,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max(max_num_tokens, max_num_seqs),
            kv_cache_tokens=max_num_tokens,
            enable_prefix_caching=enable_prefix_caching,
            cpu_kernels=cpu_kernels,
            cuda_graphs=cuda_graphs,
            speculative=speculative,
            tensor_parallel_size=tensor_parallel_size,
            master_port=master_port,
            quantization=quantize,
        )
        proposer = None if isinstance(speculator, str | Path) else speculator
        self.engine = build_engine(config, self.tokenizer, proposer)
        self.runner = self.engine.runner
        self.kv = self.engine.kv
        self._counter = itertools.count()

    def close(self) -> None:
        """Stop the engine's other processes (tensor-parallel ranks); idempotent."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        max_new_tokens: int | None = None,
        *,
        params: SamplingParams | None = None,
        return_logits: bool = False,
        prompt_prefix: torch.Tensor | PromptPrefix | None = None,
        **sampling: Any,
    ) -> list[GenerationOutput]:
        """Generate for every prompt through the engine's continuous batching: the prompts are
        prefilled together and decode together, each with `params` (default: `SamplingParams()`,
        greedy) where `max_new_tokens` and the `sampling` keywords, any of SamplingParams'
        fields (`temperature=0.7, seed=7, stop_token_ids=(2,)`, ...), replace its values
        (TypeError for a name that is not a field, ValueError for a value it rejects).
        `prompt_prefix` (prompt tuning: [virtual tokens, hidden] embeddings, as transformers'
        `inputs_embeds`) comes before every prompt."""
        if max_new_tokens is not None:
            sampling["max_new_tokens"] = max_new_tokens
        params = replace(params or SamplingParams(), **sampling)
        if isinstance(prompt_prefix, torch.Tensor):
            prompt_prefix = PromptPrefix.of(prompt_prefix)
        encoded = [self._encode(p) for p in prompts]
        if any(not ids for ids in encoded):
            raise ValueError("empty prompt")
        ids = [f"llm-{next(self._counter)}" for _ in encoded]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        reasons: dict[str, str] = {}
        recorder = LogitsRecorder()
        if return_logits:
            self.engine.observers.append(recorder)
        try:
            for request_id, prompt in zip(ids, encoded, strict=True):
                self.engine.add_request(request_id, prompt, params, None, prompt_prefix)
            while self.engine.has_unfinished_requests():
                for out in self.engine.step().outputs:
                    tokens[out.request_id] += out.new_token_ids
                    if out.finish_reason is not None:
                        reasons[out.request_id] = out.finish_reason.value
        finally:
            for request_id in ids:
                if request_id not in reasons:
                    self.engine.abort_request(request_id)
            while self.engine.has_unfinished_requests():
                self.engine.step()
            if return_logits:
                self.engine.observers.remove(recorder)
        return [
            GenerationOutput(
                prompt_token_ids=prompt,
                token_ids=tokens[i],
                text=str(self.tokenizer.decode(tokens[i], skip_special_tokens=True)),
                finish_reason=reasons[i],
                logits=recorder.pop(i)[: len(tokens[i])],
            )
            for i, prompt in zip(ids, encoded, strict=True)
        ]

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        return [int(t) for t in prompt]
