"""Request state as the scheduler sees it: token ids, progress counters and a status.

Vocabulary (vLLM v1): `num_computed_tokens` tokens have K/V in the cache; `num_tokens` are known
(prompt + output); `num_tokens_with_spec` adds the draft tokens (the nodes of the draft tree)
proposed for the next step. The scheduler's one rule is to make the first catch up with the
last.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import TYPE_CHECKING, TypeVar, overload

from engine.sampling.params import SamplingParams

if TYPE_CHECKING:
    import torch

    from engine.spec_decode.tree import DraftTree

T = TypeVar("T")


class ConstantList(Sequence[T]):
    """A read-only view of a list (no copy): indexing, slicing (returns a list), iteration, ==."""

    __slots__ = ("_items",)

    def __init__(self, items: list[T]) -> None:
        self._items = items

    @overload
    def __getitem__(self, index: int) -> T: ...
    @overload
    def __getitem__(self, index: slice) -> list[T]: ...
    def __getitem__(self, index: int | slice) -> T | list[T]:
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[T]:
        return iter(self._items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ConstantList):
            other = other._items
        return self._items == other

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ConstantList({self._items!r})"


class FinishReason(StrEnum):
    """Why a request finished. The values are the names of TGIS's `StopReason`, so the server
    maps with `StopReason.Value(reason)`; it reports TOKEN_LIMIT instead of MAX_TOKENS itself
    when it had lowered max_new_tokens to fit max_model_len."""

    EOS_TOKEN = "EOS_TOKEN"
    MAX_TOKENS = "MAX_TOKENS"
    STOP_SEQUENCE = "STOP_SEQUENCE"
    TIME_LIMIT = "TIME_LIMIT"
    CANCELLED = "CANCELLED"
    ERROR = "ERROR"


class RequestStatus(IntEnum):
    """Ordered so that every status after PREEMPTED is a finished one."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # blocks freed; waits at the front of the queue to recompute prompt + output
    FINISHED_STOPPED = 3  # an EOS token (unless ignore_eos) or a stop token id
    FINISHED_LENGTH = 4  # max_new_tokens, or the scheduler's max model length
    FINISHED_TIME_LIMIT = 5  # the deadline passed, in the queue or in flight
    FINISHED_ABORTED = 6  # cancelled by the client
    FINISHED_IGNORED = 7  # never run: the prompt leaves no room for a token in max_model_len
    FINISHED_ERROR = 8  # its own logits or token choice failed; the rest of its batch went on

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> FinishReason | None:
        """The reason reported to the client, or None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: FinishReason.EOS_TOKEN,
    RequestStatus.FINISHED_LENGTH: FinishReason.MAX_TOKENS,
    RequestStatus.FINISHED_TIME_LIMIT: FinishReason.TIME_LIMIT,
    RequestStatus.FINISHED_ABORTED: FinishReason.CANCELLED,
    RequestStatus.FINISHED_IGNORED: FinishReason.ERROR,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


PREFIX_PLACEHOLDER_ID = 0
"""The token id that stands for a prompt-prefix position in `Request.prompt_token_ids`."""


@dataclass(frozen=True, eq=False)
class PromptPrefix:
    """Prompt-tuning embeddings fed before a request's prompt tokens (TGIS's `prefix_id`).

    `embeds` are in the model's dtype on its device, in the space of the model's input
    embedding table (as transformers' `inputs_embeds`). `key` names their content for prefix
    caching: requests whose prefixes have equal keys share KV blocks, so equal keys must mean
    equal embeddings (`of` hashes them).
    """

    embeds: torch.Tensor  # [num_virtual_tokens, hidden]
    key: bytes

    def __post_init__(self) -> None:
        if self.embeds.dim() != 2 or self.embeds.shape[0] == 0:
            shape = tuple(self.embeds.shape)
            raise ValueError(f"prompt prefix must be [virtual tokens > 0, hidden], got {shape}")

    @classmethod
    def of(cls, embeds: torch.Tensor) -> PromptPrefix:
        """`embeds` keyed by a SHA-256 of their dtype, shape and bytes."""
        import torch  # here, so that the scheduler's modules import without torch

        data = embeds.detach().contiguous().cpu().view(-1).view(torch.uint8)
        digest = hashlib.sha256(f"prompt-prefix {embeds.dtype} {tuple(embeds.shape)}".encode())
        digest.update(data.numpy().tobytes())
        return cls(embeds, digest.digest())

    @property
    def num_tokens(self) -> int:
        return int(self.embeds.shape[0])


@dataclass(eq=False)
class Request:
    """One generation request.

    `prompt_token_ids` must be non-empty (it is stored as a tuple). `arrival_time` and `deadline`
    are on the same clock as the `now` passed to the scheduler (time.monotonic() in the engine);
    `deadline` is arrival + time_limit, or None. `eos_token_ids` are the model's EOS ids, ignored
    when `sampling_params.ignore_eos`; `sampling_params.stop_token_ids` always stop.
    `draft_tree` holds the draft tokens to verify next step and their tree shape (set via
    `Scheduler.update_draft_trees`); the scheduler owns every other mutable field.

    With a `prompt_prefix` of P virtual tokens, the given `prompt_token_ids` are the real
    prompt: the stored `prompt_token_ids` (and so `all_token_ids`, `num_tokens`, positions)
    start with P `PREFIX_PLACEHOLDER_ID`s whose embeddings the model takes from the prefix.
    Whatever reads token ids as text (penalties) skips the first `num_prefix_tokens`.
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    sampling_params: SamplingParams
    arrival_time: float
    deadline: float | None = None
    eos_token_ids: frozenset[int] = frozenset()
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    draft_tree: DraftTree | None = None
    num_preemptions: int = 0
    prompt_prefix: PromptPrefix | None = None
    _output_token_ids: list[int] = field(init=False, repr=False, default_factory=list)
    _all_token_ids: list[int] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        self.prompt_token_ids = tuple(self.prompt_token_ids)
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: empty prompt")
        if self.prompt_prefix is not None:
            placeholders = (PREFIX_PLACEHOLDER_ID,) * self.prompt_prefix.num_tokens
            self.prompt_token_ids = placeholders + self.prompt_token_ids
        self._all_token_ids = list(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> ConstantList[int]:
        return ConstantList(self._output_token_ids)

    @property
    def all_token_ids(self) -> ConstantList[int]:
        """Prompt + output token ids (no drafts), as a read-only view."""
        return ConstantList(self._all_token_ids)

    @property
    def num_prefix_tokens(self) -> int:
        """Virtual tokens of the prompt prefix: the first positions of `prompt_token_ids`."""
        return 0 if self.prompt_prefix is None else self.prompt_prefix.num_tokens

    @property
    def cache_salt(self) -> bytes:
        """What the KV prefix cache mixes into this request's block digests: the prompt
        prefix's key (empty without one), so placeholder ids of different prefixes never
        share blocks."""
        return b"" if self.prompt_prefix is None else self.prompt_prefix.key

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        num_drafts = 0 if self.draft_tree is None else self.draft_tree.num_drafts
        return len(self._all_token_ids) + num_drafts

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        self._output_token_ids.extend(ids)
        self._all_token_ids.extend(ids)
