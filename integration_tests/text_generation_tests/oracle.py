"""Expected responses computed at test time with transformers, independently of the server.

`GenerationOracle.expected` builds the `json_format.MessageToDict` form of the unary
`GenerationResponse` TGIS returns for one greedy input (docs/tgis-compatibility.md: "Validation",
"Stopping", "Output") from
transformers' own `LlamaForCausalLM.generate` on the same checkpoint: token ids, processed scores
(EOS masked before min_new_tokens, repetition and length penalties applied by transformers'
processors), stop reasons, stop sequences on the decoded text, token details and truncation.
`expected_tokenize` does the same for Tokenize with the model's tokenizer. Only greedy decoding
is covered; sampling output depends on the server's random streams.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from google.protobuf import json_format
from transformers import AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerBase

from server.pb import generation_pb2 as pb

DEFAULT_MAX_NEW_TOKENS = 20
NEAR_TIE = 1e-3
"""A greedy step whose top-2 processed scores differ by less than this is ill-posed: fp32
rounding in a different kernel may pick the other token."""


class OracleError(AssertionError):
    """The case cannot be checked against the oracle (unsupported parameters, a near tie)."""


@dataclass(frozen=True)
class Limits:
    """The server's MAX_SEQUENCE_LENGTH and DEFAULT_INCLUDE_STOP_SEQS."""

    max_sequence_length: int
    default_include_stop_seqs: bool = True


class GenerationOracle:
    """transformers' Llama and tokenizer for one checkpoint folder, loaded on first use."""

    def __init__(self, model_dir: Path, limits: Limits) -> None:
        self.model_dir = model_dir
        self.limits = limits
        self._generations: dict[tuple[Any, ...], tuple[list[int], list[torch.Tensor]]] = {}

    @cached_property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return AutoTokenizer.from_pretrained(str(self.model_dir))

    @cached_property
    def model(self) -> LlamaForCausalLM:
        model = LlamaForCausalLM.from_pretrained(str(self.model_dir), dtype=torch.float32)
        return model.eval()

    @cached_property
    def eos_token_id(self) -> int:
        eos = self.model.generation_config.eos_token_id
        if isinstance(eos, list):
            eos = eos[0]
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return int(eos)

    def expected(self, text: str, params: dict[str, Any]) -> dict[str, Any]:
        """The unary response dict for input `text` under request `params` (a dict as in the
        YAML, parsed into `fmaas.Parameters`)."""
        p = json_format.ParseDict(params, pb.Parameters())
        if p.method != pb.GREEDY:
            raise OracleError("the oracle covers greedy decoding only")
        if p.stopping.time_limit_millis:
            raise OracleError("the oracle does not model time limits")
        input_ids = list(self.tokenizer(text)["input_ids"])
        keep = p.truncate_input_tokens
        if 0 < keep < len(input_ids):
            input_ids = input_ids[-keep:]
            if self._adds_bos:
                input_ids[0] = int(self.tokenizer.bos_token_id)
        room = self.limits.max_sequence_length - len(input_ids)
        requested = p.stopping.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
        max_new = min(requested, room)
        prompt = input_ids or [self._empty_prompt_token]
        tokens, scores = self._greedy(prompt, max_new, p)
        out: dict[str, Any] = {}
        if input_ids:
            out["inputTokenCount"] = len(input_ids)
        generated, stop_reason, stop_sequence, gen_text = self._stop(tokens, max_new, p)
        if max_new < requested and stop_reason == "MAX_TOKENS":
            stop_reason = "TOKEN_LIMIT"
        full_text = (text if p.response.input_text else "") + gen_text
        if generated:
            out["generatedTokenCount"] = generated
        if full_text:
            out["text"] = full_text
        out["stopReason"] = stop_reason
        if stop_sequence:
            out["stopSequence"] = stop_sequence
        r = p.response
        if r.generated_tokens:
            out["tokens"] = [self._detail(tokens[i], scores[i], r) for i in range(generated)]
        if r.input_tokens:
            out["inputTokens"] = self._input_details(input_ids, r)
        return out

    @cached_property
    def _adds_bos(self) -> bool:
        bos = self.tokenizer.bos_token_id
        ids = self.tokenizer("a")["input_ids"]
        return bos is not None and bool(ids) and ids[0] == bos

    @cached_property
    def _empty_prompt_token(self) -> int:
        """An empty input runs on a lone BOS (EOS without one); it counts 0 input tokens."""
        bos = self.tokenizer.bos_token_id
        return int(bos if bos is not None else self.eos_token_id)

    def _greedy(
        self, prompt: list[int], max_new: int, p: pb.Parameters
    ) -> tuple[list[int], list[torch.Tensor]]:
        """transformers' greedy generate: the tokens and each step's processed scores (cached
        per prompt and generation settings)."""
        kwargs: dict[str, Any] = {}
        if p.decoding.repetition_penalty:
            kwargs["repetition_penalty"] = p.decoding.repetition_penalty
        if p.decoding.HasField("length_penalty"):
            lp = p.decoding.length_penalty
            kwargs["exponential_decay_length_penalty"] = (lp.start_index, lp.decay_factor)
        key = (tuple(prompt), max_new, p.stopping.min_new_tokens, *sorted(kwargs.items()))
        if key not in self._generations:
            self._generations[key] = self._generate(prompt, max_new, p, kwargs)
        return self._generations[key]

    def _generate(
        self, prompt: list[int], max_new: int, p: pb.Parameters, kwargs: dict[str, Any]
    ) -> tuple[list[int], list[torch.Tensor]]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                min_new_tokens=p.stopping.min_new_tokens,
                do_sample=False,
                eos_token_id=self.eos_token_id,
                pad_token_id=self.eos_token_id,
                output_scores=True,
                return_dict_in_generate=True,
                **kwargs,
            )
        tokens = out.sequences[0, len(prompt) :].tolist()
        scores = [s[0].float() for s in out.scores]
        for i, s in enumerate(scores):
            top2 = s.topk(2).values
            if (top2[0] - top2[1]).item() < NEAR_TIE:
                raise OracleError(f"near tie at generated token {i}: pick another prompt")
        return tokens, scores

    def _stop(self, tokens: list[int], max_new: int, p: pb.Parameters) -> tuple[int, str, str, str]:
        """TGIS's stopping order over the generated tokens: (generated count, stop reason,
        stop sequence, text)."""
        eos = bool(tokens) and tokens[-1] == self.eos_token_id and len(tokens) <= max_new
        texts = [self._decode(tokens[:k]) for k in range(len(tokens) + 1)]
        stops = list(p.stopping.stop_sequences)
        include = (
            p.stopping.include_stop_sequence
            if p.stopping.HasField("include_stop_sequence")
            else self.limits.default_include_stop_seqs
        )
        for k in range(max(1, p.stopping.min_new_tokens), len(tokens)):
            old, new = texts[k - 1], texts[k]
            for stop in stops:
                start = new.rfind(stop, max(0, len(old) - len(stop) + 1))
                if start >= 0:
                    cut = new[: start + len(stop)] if include else new[:start]
                    return k, "STOP_SEQUENCE", stop, cut
        if eos:
            return len(tokens), "EOS_TOKEN", "", texts[-2]
        return len(tokens), "MAX_TOKENS", "", texts[-1]

    def _decode(self, token_ids: list[int]) -> str:
        ids = [t for t in token_ids if t != self.eos_token_id]
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def _piece(self, token_id: int) -> str:
        return str(self.tokenizer.convert_ids_to_tokens(token_id))

    def _detail(self, token_id: int, scores: torch.Tensor, r: pb.ResponseOptions) -> dict[str, Any]:
        """TokenInfo of one token given the processed scores of its step
        (docs/tgis-compatibility.md, "Output")."""
        info: dict[str, Any] = {"text": self._piece(token_id)}
        logprobs = scores.log_softmax(-1)
        if r.token_logprobs:
            info["logprob"] = logprobs[token_id].item()
        if r.token_ranks:
            info["rank"] = int((scores > scores[token_id]).sum()) + 1
        if r.top_n_tokens:
            info["topTokens"] = self._top_tokens(scores, logprobs, r)
        return info

    def _top_tokens(
        self, scores: torch.Tensor, logprobs: torch.Tensor, r: pb.ResponseOptions
    ) -> list[dict[str, Any]]:
        """Every token scoring at least the n-th highest finite score, at most 4n: by
        descending logprob (ties: lower id) with logprobs, else in id order."""
        n = r.top_n_tokens
        finite = scores[torch.isfinite(scores)]
        threshold = finite.topk(min(n, finite.numel())).values[-1]
        ids = [int(i) for i in torch.nonzero(scores >= threshold).flatten()]
        ids.sort(key=lambda i: (-logprobs[i].item(), i))
        ids = ids[: 4 * n]
        if not r.token_logprobs:
            return [{"text": self._piece(i)} for i in sorted(ids)]
        return [{"text": self._piece(i), "logprob": logprobs[i].item()} for i in ids]

    def _input_details(self, input_ids: list[int], r: pb.ResponseOptions) -> list[dict[str, Any]]:
        """The first input token has logprob NaN only; each later one is scored by the raw
        logits given the tokens before it."""
        if not input_ids:
            return []
        with torch.no_grad():
            logits = self.model(torch.tensor([input_ids])).logits[0].float()
        details: list[dict[str, Any]] = [{"text": self._piece(input_ids[0]), "logprob": "NaN"}]
        for j, token in enumerate(input_ids[1:]):
            details.append(self._detail(token, logits[j], r))
        return details


def expected_tokenize(
    tokenizer: PreTrainedTokenizerBase, request: dict[str, Any]
) -> dict[str, Any]:
    """The BatchedTokenizeResponse dict of a BatchedTokenizeRequest dict."""
    req = json_format.ParseDict(request, pb.BatchedTokenizeRequest())
    responses = []
    for r in req.requests:
        enc = tokenizer(r.text, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        offsets = [tuple(o) for o in enc["offset_mapping"]]
        keep = req.truncate_input_tokens
        if 0 < keep < len(ids):
            ids, offsets = ids[-keep:], offsets[-keep:]
        out: dict[str, Any] = {}
        if ids:
            out["tokenCount"] = len(ids)
        if req.return_tokens and ids:
            out["tokens"] = [str(t) for t in tokenizer.convert_ids_to_tokens(ids)]
        if req.return_offsets and ids:
            out["offsets"] = [
                {k: v for k, v in (("start", s), ("end", e)) if v} for s, e in offsets
            ]
        responses.append(out)
    return {"responses": responses} if responses else {}
