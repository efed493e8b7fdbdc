"""From a request's input texts to what the engine takes: tokenization, TGIS's input
validation and truncation, and the prompt prefix (`InputPreparer`); protobuf-free. Runs on the
servicer's tokenization pool, never on the event loop."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from engine.request import PromptPrefix
from server import convert
from server.messages import (
    prefix_lookup_error,
    prefix_not_found_reason,
    prefix_token_details_error,
    tokenizer_error,
)
from server.metrics import ServerMetrics
from server.prefix_store import PrefixStore
from server.validation import DecodingParams, Limits, validate_input


@dataclass(frozen=True)
class PreparedInput:
    """A validated, tokenized input: `input_token_ids` after truncation (their count is the
    reported input_token_count); `prompt_token_ids` go to the model: the same, or a single
    BOS/EOS for an empty input, after the `prompt_prefix`'s embeddings when there is one."""

    text: str
    input_token_ids: list[int]
    prompt_token_ids: list[int]
    input_token_count: int
    params: DecodingParams
    prompt_prefix: PromptPrefix | None = None


class InputPreparer:
    """Tokenizes and validates inputs against `limits`, observing the input-length metrics. A
    `prefix_id` is looked up in `prefixes` (without a store, every id is not found, a
    `tgi_prompt_load_failure`); its virtual tokens count toward the input length."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        limits: Limits,
        metrics: ServerMetrics,
        prefixes: PrefixStore | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.metrics = metrics
        self.prefixes = prefixes
        bos = tokenizer.bos_token_id
        probe = list(tokenizer("a")["input_ids"])
        self._bos_id: int | None = bos if probe and probe[0] == bos else None
        fallback = bos if bos is not None else tokenizer.eos_token_id
        self._empty_prompt = [fallback if fallback is not None else 0]

    def prepare_all(
        self, texts: Sequence[str], params: DecodingParams, prefix_id: str | None = None
    ) -> list[PreparedInput]:
        """`prepare` each input in order after the prompt prefix `prefix_id`, if any; the
        first failure raises."""
        prefix = self.prefix(prefix_id, params)
        return [self.prepare(text, params, prefix) for text in texts]

    def prefix(self, prefix_id: str | None, params: DecodingParams) -> PromptPrefix | None:
        """The prompt prefix `prefix_id` (None: no prefix). ValidationError with TGIS's message
        when it cannot be loaded, and when the request asks for input token details, which
        prompt-prefix positions do not have."""
        if prefix_id is None:
            return None
        if self.prefixes is None:
            self.metrics.prompt_load_failure.inc()
            raise prefix_lookup_error(prefix_id, prefix_not_found_reason(prefix_id))
        prefix = self.prefixes.get(prefix_id)
        if params.input_tokens and convert.wants_token_details(params):
            raise prefix_token_details_error()
        return prefix

    def prepare(
        self, text: str, params: DecodingParams, prefix: PromptPrefix | None = None
    ) -> PreparedInput:
        """One input: tokenized (TokenizerFailure on a tokenizer error), validated
        (ValidationError with TGIS's message), truncated to `truncate_input_tokens` (the first
        kept token replaced by BOS where the tokenizer adds one)."""
        try:
            ids = list(self.tokenizer(text)["input_ids"])
        except Exception as e:
            raise tokenizer_error(str(e)) from e
        return self.prepare_tokens(text, ids, params, prefix)

    def prepare_tokens(
        self,
        text: str,
        ids: list[int],
        params: DecodingParams,
        prefix: PromptPrefix | None = None,
    ) -> PreparedInput:
        """`prepare` for an input already tokenized into `ids` (special tokens included), whose
        text is `text`."""
        self.metrics.request_raw_input_length.observe(len(ids))
        prefix_length = 0 if prefix is None else prefix.num_tokens
        validated = validate_input(params, len(ids), self.limits, prefix_length)
        self.metrics.request_input_length.observe(validated.input_length)
        truncate = validated.params.truncate_input_tokens
        if truncate:
            ids = ids[-truncate:]
            if self._bos_id is not None:
                ids[0] = self._bos_id
        self.metrics.request_max_new_tokens.observe(validated.params.max_new_tokens)
        prompt = ids or list(self._empty_prompt)
        return PreparedInput(text, ids, prompt, validated.input_length, validated.params, prefix)
