"""TGIS's router logic for one input, protobuf-free: UTF-8-safe incremental detokenization
(`IncrementalDetokenizer`) and `OutputTracker`: stop sequences on the decoded text, the
TGIS stop reason, and the split into `OutputChunk`s.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from engine.outputs import EngineOutput
from engine.request import FinishReason
from engine.sampling.sampler import TokenLogprobs
from server import convert
from server.convert import OutputChunk, TokenDetail
from server.errors import GenerationError
from server.validation import DecodingParams


class IncrementalDetokenizer:
    """Decodes a token stream as a continuation of `context_ids` (so a leading space survives)
    and returns only complete text: a delta ending in U+FFFD (incomplete UTF-8) is held back
    until later tokens complete it, or until `flush()`."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        context_ids: Sequence[int],
        skip_special_tokens: bool,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(context_ids)
        self._prefix = 0
        self._read = len(self._ids)

    def _delta(self, final: bool) -> str:
        decode = self._tokenizer.decode
        prefix_text = str(
            decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        )
        new_text = str(decode(self._ids[self._prefix :], skip_special_tokens=self._skip))
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            self._prefix, self._read = self._read, len(self._ids)
            return str(new_text[len(prefix_text) :])
        return ""

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._delta(final=False)

    def flush(self) -> str:
        """Whatever is still held back, incomplete characters included."""
        return self._delta(final=True)


class OutputTracker:
    """TGIS's per-input output rules (stop sequences, stop reasons) over the engine's tokens.

    `add` turns a `EngineOutput` into one `OutputChunk` per token; the last chunk is finished.
    A final EOS token is counted but not decoded. From `min_new_tokens` on, a stop sequence
    found in the text the token added finishes the request (STOP_SEQUENCE) and cuts the text
    after (or, when not included, before) the match; the caller must then abort the engine
    request. When stop sequences are excluded, the last `len(longest) - 1` characters are held
    back, so that text already handed out never needs retracting.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        params: DecodingParams,
        include_stop_sequence: bool,
        skip_special_tokens: bool,
    ) -> None:
        self._tokenizer = tokenizer
        self._params = params
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids[-5:], skip_special_tokens)
        self._include = include_stop_sequence
        longest = max((len(s) for s in params.stop_sequences), default=0)
        self._holdback = 0 if include_stop_sequence else max(longest - 1, 0)
        self._text = ""
        self._sent = 0
        self.count = 0
        self.finished = False
        self.prompt_logprobs: list[TokenLogprobs] | None = None

    def add(self, out: EngineOutput) -> list[OutputChunk]:
        if out.finish_reason == FinishReason.ERROR:
            raise GenerationError(out.error or "request could not be scheduled")
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        chunks = []
        for i, token in enumerate(out.new_token_ids):
            last = out.finished and i == len(out.new_token_ids) - 1
            lp = out.logprobs[i] if out.logprobs is not None else None
            chunks.append(self._add_token(token, lp, out.finish_reason if last else None))
            if self.finished:
                return chunks
        if out.finished and not self.finished:  # finished without a token (time limit)
            chunks.append(self._finish(out.finish_reason or FinishReason.CANCELLED, None))
        return chunks

    def _add_token(
        self, token: int, lp: TokenLogprobs | None, reason: FinishReason | None
    ) -> OutputChunk:
        self.count += 1
        old_len = len(self._text)
        if reason != FinishReason.EOS_TOKEN:
            self._text += self._detok.add(token)
        detail = self._token_detail(token, lp)
        if reason is None and self.count >= self._params.min_new_tokens:
            match = self._find_stop_sequence(old_len)
            if match is not None:
                start, stop = match
                self._text = self._text[: start + len(stop) if self._include else start]
                return self._finish(FinishReason.STOP_SEQUENCE, detail, stop)
        if reason is not None:
            return self._finish(reason, detail)
        end = max(self._sent, len(self._text) - self._holdback)
        chunk = OutputChunk(self._text[self._sent : end], self.count, detail)
        self._sent = end
        return chunk

    def _finish(
        self, reason: FinishReason, detail: list[TokenDetail] | None, stop: str = ""
    ) -> OutputChunk:
        self.finished = True
        if reason != FinishReason.STOP_SEQUENCE:
            self._text += self._detok.flush()
        stop_reason = convert.stop_reason(reason, self._params.max_is_token_limit)
        return OutputChunk(self._text[self._sent :], self.count, detail or [], stop_reason, stop)

    def _find_stop_sequence(self, old_len: int) -> tuple[int, str] | None:
        """The first stop sequence (in request order) ending in the newly added text, and its
        last start position there."""
        for stop in self._params.stop_sequences:
            start = self._text.rfind(stop, max(0, old_len - len(stop) + 1))
            if start >= 0:
                return start, stop
        return None

    def _token_detail(self, token: int, lp: TokenLogprobs | None) -> list[TokenDetail]:
        if not self._params.generated_tokens:
            return []
        if lp is None:
            return [TokenDetail(self._pieces([token])[0])]
        return [convert.token_detail(lp, self._params, self._pieces)]

    def input_tokens(self, token_ids: Sequence[int]) -> list[TokenDetail]:
        """The `input_tokens` details of the input `token_ids` (see convert)."""
        return convert.input_token_details(
            token_ids, self.prompt_logprobs, self._params, self._pieces
        )

    def _pieces(self, token_ids: Sequence[int]) -> list[str]:
        return [str(t) for t in self._tokenizer.convert_ids_to_tokens(list(token_ids))]
