"""What `LLMEngine.step()` reports: each request's new tokens (`EngineOutput`), the step's
figures (`StepStats`) and the requests' life events (`RequestEvent`), as vLLM v1's
EngineCoreOutputs with its SchedulerStats and EngineCoreEvents. Plain dataclasses: whoever
serves the engine (metrics, traces, streams) reads these and nothing of its insides."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from engine.request import FinishReason, RequestStatus
from engine.sampling.sampler import TokenLogprobs


@dataclass(frozen=True)
class EngineOutput:
    """What one request gained in one step: tokens to stream and, if finished, why. When the
    request's params ask for `logprobs`, one `TokenLogprobs` per token of `new_token_ids`."""

    request_id: str
    new_token_ids: list[int]
    status: RequestStatus
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    """Drafts accepted; may exceed what was kept after a stop."""
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    """With `SamplingParams.prompt_logprobs`, on the request's first output with tokens: the
    raw (unprocessed) details of prompt tokens 1 .. n-1, each given the tokens before it."""
    draft_depth: int = 0
    """The longest path of the draft tree verified this step (0: no speculation); the request
    gained `num_accepted_tokens` of those drafts plus one token of its own."""
    error: str | None = None
    """Why the request finished with FinishReason.ERROR, when its own logits or token choice
    failed this step."""

    @property
    def finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason


class RequestEventType(StrEnum):
    """A step in a request's life, as vLLM v1's EngineCoreEventType (plus the first token and
    the end)."""

    QUEUED = "queued"
    """Added to the waiting queue (reported by the next step)."""
    SCHEDULED = "scheduled"
    """Moved from the waiting queue into the running batch: first admission, or again after a
    preemption."""
    FIRST_TOKEN = "first_token"
    """The step gave the request its first output token."""
    PREEMPTED = "preempted"
    """Its KV blocks were taken back; it waits at the front of the queue to recompute."""
    FINISHED = "finished"
    """Finished, run or not (its `EngineOutput` says why)."""


@dataclass(frozen=True)
class RequestEvent:
    """`type` happened to request `request_id` at `timestamp` (`time.monotonic()`)."""

    request_id: str
    type: RequestEventType
    timestamp: float


@dataclass(frozen=True)
class StepStats:
    """One step's figures, and the scheduler's queues and KV pool after it."""

    num_scheduled_reqs: int = 0
    """Requests the forward pass ran."""
    num_scheduled_tokens: int = 0
    """Tokens it computed: `num_prefill_tokens + num_decode_tokens`."""
    num_prefill_tokens: int = 0
    """Tokens of requests catching up on known tokens (a prompt, or a recomputation after a
    preemption), chunk by chunk."""
    num_decode_tokens: int = 0
    """Tokens of requests one token behind: that token plus their drafts."""
    num_admitted_reqs: int = 0
    """Requests the step moved from the waiting queue into the running batch."""
    num_preempted_reqs: int = 0
    num_prefix_hit_tokens: int = 0
    """Prompt tokens the step took from the prefix cache instead of computing them."""
    num_generated_tokens: int = 0
    """Tokens the step appended to requests (after stops)."""

    num_spec_reqs: int = 0
    """Requests whose draft tree the step verified."""
    num_draft_tokens: int = 0
    """Draft tokens (tree nodes) the step verified."""
    num_accepted_tokens: int = 0
    """Of those, the drafts accepted (each request also gains one token of its own)."""
    num_proposed_reqs: int = 0
    """Requests the drafter gave a tree for the next step."""
    num_proposed_tokens: int = 0
    """Draft tokens (tree nodes) proposed for the next step."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    """Queued or preempted requests waiting for admission."""
    num_running_tokens: int = 0
    """Prompt and output tokens of the running requests."""
    num_remaining_tokens: int = 0
    """Sum over the running requests of `max_new_tokens` minus their output tokens."""
    num_used_blocks: int = 0
    num_blocks: int = 0
    """KV blocks held by requests, and in the whole pool."""

    @property
    def kv_cache_usage(self) -> float:
        """The fraction of the KV pool held by requests."""
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def num_tokens_per_spec_req(self) -> float:
        """Tokens a verifying request gained per step, on average (accepted drafts + 1)."""
        if not self.num_spec_reqs:
            return 0.0
        return (self.num_accepted_tokens + self.num_spec_reqs) / self.num_spec_reqs


@dataclass(frozen=True)
class EngineStepOutput:
    """What one `LLMEngine.step()` did: the requests that gained tokens or finished (those the
    scheduler finished without running included), the step's figures, and the events of the
    requests since the previous step, in the order they happened."""

    outputs: list[EngineOutput] = field(default_factory=list)
    stats: StepStats = field(default_factory=StepStats)
    events: list[RequestEvent] = field(default_factory=list)
