"""Prometheus metrics with TGIS's `tgi_*` names, on a private registry; the engine's share is
built from each step's `StepStats` and `EngineOutput`s (`observe_step`).

Not reported, as their concept does not exist here (README.md, "TLS, health and metrics"):
`tgi_queue_jump` (admission is strictly FCFS), `tgi_granular_batch_addition` and
`tgi_prefill_weight_limit_exceeded` (no weight model: admission counts KV blocks, long prompts
prefill in chunks) and `tgi_prefill_padding_limit_exceeded` (batches are not padded).

Counters are exposed both as `name_total` (prometheus_client's convention) and as plain `name`
(TGIS's exporter), like IBM TGIS main. The registry is per `ServerMetrics`, so several servers
(or tests) in one process do not collide. Metric updates are thread-safe.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Summary,
    generate_latest,
)
from prometheus_client.core import Metric, UnknownMetricFamily
from prometheus_client.registry import Collector

from engine.outputs import EngineOutput, StepStats

_DURATION_BUCKETS = tuple(0.00015 * 1.5**k for k in range(35))


def _linear_buckets(upper: int, count: int = 64) -> tuple[float, ...]:
    step = max(1.0, upper / count)
    return tuple(sorted({round(step * (i + 1), 3) for i in range(count)}))


class _PlainCounterNames(Collector):
    """Re-exports each counter's `_total` samples without the suffix (untyped, like TGIS)."""

    def __init__(self, counters: list[Counter]) -> None:
        self._counters = counters

    def describe(self) -> Iterator[Metric]:
        """Nothing: the plain names would clash with the counters' in the registry's check,
        though not in the exposition (which names the counters `name_total`)."""
        return iter(())

    def collect(self) -> Iterator[Metric]:
        for counter in self._counters:
            for family in counter.collect():
                plain = UnknownMetricFamily(family.name, family.documentation)
                for s in family.samples:
                    if s.name.endswith("_total"):
                        plain.add_sample(family.name, s.labels, s.value)
                yield plain


class ServerMetrics:
    """Every metric the server reports. Histogram bucket bounds depend on the server limits."""

    def __init__(self, max_sequence_length: int, max_new_tokens: int, max_batch_size: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.request_count = Counter(
            "tgi_request_count",
            "Generation requests: Generate (single, batch), GenerateStream (stream) and the "
            "HTTP API's (openai_completions, openai_chat, each with _stream when streamed)",
            ["kind"],
            registry=r,
        )
        self.request_input_count = Counter("tgi_request_input_count", "Generate inputs", registry=r)
        self.request_failure = Counter(
            "tgi_request_failure", "Failed requests by cause", ["err"], registry=r
        )
        self.request_success = Counter(
            "tgi_request_success", "Successful requests", ["stop_reason", "kind"], registry=r
        )
        self.tokenize_request_count = Counter(
            "tgi_tokenize_request_count", "Tokenize calls", registry=r
        )
        self.tokenize_request_input_count = Counter(
            "tgi_tokenize_request_input_count", "Tokenize inputs", registry=r
        )
        self.batch_inference_count = Counter(
            "tgi_batch_inference_count", "Model calls", ["method"], registry=r
        )
        self.batch_inference_success = Counter(
            "tgi_batch_inference_success", "Successful model calls", ["method"], registry=r
        )
        self.batch_inference_failure = Counter(
            "tgi_batch_inference_failure", "Failed model calls", ["method", "reason"], registry=r
        )
        self.batch_concatenation_count = Counter(
            "tgi_batch_concatenation_count",
            "Steps in which new requests joined a running batch",
            registry=r,
        )
        self.prompt_load_failure = Counter(
            "tgi_prompt_load_failure",
            "Failed prompt-prefix (prefix_id) lookups: unknown or invalid ids, bad tensors",
            registry=r,
        )
        self.prompt_load_duration = Histogram(
            "tgi_prompt_load_duration",
            "Time to load a prompt prefix from PREFIX_STORE_PATH (s), cache misses only",
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.request_preemptions = Counter(
            "tgi_request_preemptions",
            "Running requests preempted (KV blocks freed, recomputed later) for lack of KV blocks",
            registry=r,
        )
        self.http_request_count = Counter(
            "tgi_http_request_count",
            "Requests of the OpenAI-compatible HTTP API, by route and response status",
            ["route", "status"],
            registry=r,
        )
        counters = [
            self.http_request_count,
            self.request_count,
            self.request_input_count,
            self.request_failure,
            self.request_success,
            self.tokenize_request_count,
            self.tokenize_request_input_count,
            self.batch_inference_count,
            self.batch_inference_success,
            self.batch_inference_failure,
            self.batch_concatenation_count,
            self.prompt_load_failure,
            self.request_preemptions,
        ]
        r.register(_PlainCounterNames(counters))

        seq_buckets = _linear_buckets(max_sequence_length)
        new_buckets = _linear_buckets(max_new_tokens)
        self.request_input_length = Histogram(
            "tgi_request_input_length", "Input tokens", buckets=seq_buckets, registry=r
        )
        self.request_raw_input_length = Summary(
            "tgi_request_raw_input_length", "Input tokens before validation", registry=r
        )
        self.request_max_new_tokens = Histogram(
            "tgi_request_max_new_tokens",
            "Requested max_new_tokens",
            buckets=new_buckets,
            registry=r,
        )
        self.request_generated_tokens = Histogram(
            "tgi_request_generated_tokens", "Generated tokens", buckets=new_buckets, registry=r
        )
        self.request_total_tokens = Histogram(
            "tgi_request_total_tokens",
            "Input + generated tokens",
            buckets=seq_buckets,
            registry=r,
        )
        self.request_duration = Histogram(
            "tgi_request_duration", "End-to-end time (s)", buckets=_DURATION_BUCKETS, registry=r
        )
        self.request_validation_duration = Histogram(
            "tgi_request_validation_duration",
            "Validation time (s)",
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.request_queue_duration = Histogram(
            "tgi_request_queue_duration",
            "Time from arrival to the first engine step (s)",
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.request_inference_duration = Histogram(
            "tgi_request_inference_duration",
            "Time from the first engine step to completion (s)",
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.request_mean_time_per_token_duration = Histogram(
            "tgi_request_mean_time_per_token_duration",
            "Inference time per generated token (s)",
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.tokenize_request_tokens = Histogram(
            "tgi_tokenize_request_tokens",
            "Tokens per Tokenize call",
            buckets=tuple(float(2**k) for k in range(6, 20)),
            registry=r,
        )
        self.tokenize_request_duration = Histogram(
            "tgi_tokenize_request_duration",
            "Tokenize latency (s)",
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.batch_inference_duration = Histogram(
            "tgi_batch_inference_duration",
            "Model step latency (s)",
            ["method", "makeup"],
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.batch_inference_forward_duration = Histogram(
            "tgi_batch_inference_forward_duration",
            "Engine step time: schedule, forward pass, sampling (s)",
            ["method", "makeup"],
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.batch_inference_tokproc_duration = Histogram(
            "tgi_batch_inference_tokproc_duration",
            "Time handing one step's tokens to the requests (s)",
            ["method", "makeup"],
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.batch_next_tokens = Summary(
            "tgi_batch_next_tokens",
            "Prompt tokens of the requests that join the batch in a step",
            registry=r,
        )
        self.batch_inference_batch_size = Histogram(
            "tgi_batch_inference_batch_size",
            "Requests per model step",
            ["method"],
            buckets=tuple(float(i) for i in range(1, max_batch_size + 1)),
            registry=r,
        )
        self.batch_current_size = Gauge("tgi_batch_current_size", "Running requests", registry=r)
        self.batch_input_tokens = Gauge(
            "tgi_batch_input_tokens", "Tokens (prompt + generated) of the running batch", registry=r
        )
        self.batch_max_remaining_tokens = Gauge(
            "tgi_batch_max_remaining_tokens",
            "Sum over the running batch of max_new_tokens minus generated tokens",
            registry=r,
        )
        self.queue_size = Gauge("tgi_queue_size", "Queued requests", registry=r)
        self.kv_cache_blocks_total = Gauge(
            "tgi_kv_cache_blocks_total", "KV cache blocks in the pool", registry=r
        )
        self.kv_cache_blocks_used = Gauge(
            "tgi_kv_cache_blocks_used", "KV cache blocks held by requests", registry=r
        )
        self.prefix_cache_hit_tokens = Counter(
            "tgi_prefix_cache_hit_tokens",
            "Prompt tokens whose KV blocks came from the prefix cache instead of being computed",
            registry=r,
        )

        self.spec_steps = Counter(
            "tgi_spec_steps", "Request steps that verified a draft tree", ["method"], registry=r
        )
        self.spec_proposed_tokens = Counter(
            "tgi_spec_proposed_tokens",
            "Draft tokens proposed: per verified tree, its longest path (the most it can add)",
            ["method"],
            registry=r,
        )
        self.spec_accepted_tokens = Counter(
            "tgi_spec_accepted_tokens",
            "Draft tokens accepted (not counting the model's own token of each step)",
            ["method"],
            registry=r,
        )
        self.spec_tokens_per_step = Histogram(
            "tgi_spec_tokens_per_step",
            "Tokens a request gained in one speculative step (accepted drafts + 1)",
            ["method"],
            buckets=tuple(range(1, 17)),
            registry=r,
        )
        self.spec_step_duration = Histogram(
            "tgi_spec_step_duration",
            "Engine steps that verified draft trees: the step, drafting the next included (s)",
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.spec_head_proposed = Counter(
            "tgi_spec_head_proposed",
            "Verified trees deep enough to reach this head position (0 = first draft)",
            ["method", "head"],
            registry=r,
        )
        self.spec_head_accepted = Counter(
            "tgi_spec_head_accepted",
            "Verified trees whose accepted path reached this head position",
            ["method", "head"],
            registry=r,
        )
        r.register(
            _PlainCounterNames(
                [
                    self.spec_steps,
                    self.spec_proposed_tokens,
                    self.spec_accepted_tokens,
                    self.spec_head_proposed,
                    self.spec_head_accepted,
                ]
            )
        )

    def observe_step(
        self,
        method: str,
        stats: StepStats,
        outputs: Sequence[EngineOutput],
        methods: Mapping[str, str],
        joined_prompt_lengths: Sequence[int],
        num_running_before: int,
    ) -> None:
        """Count one successful engine step of `method` ("prefill" or "next_token"): its batch
        and the engine's state after it (`stats`), the speculation of each of its `outputs`
        whose request's decoding method `methods` gives ("greedy" or "sample"), and the prompt
        lengths of the requests that joined the batch (first scheduled), which were
        concatenated to a running batch when `num_running_before` requests ran before it."""
        self.batch_inference_count.labels(method).inc()
        self.batch_inference_success.labels(method).inc()
        self.batch_inference_batch_size.labels(method).observe(stats.num_scheduled_reqs)
        if joined_prompt_lengths:
            self.batch_next_tokens.observe(sum(joined_prompt_lengths))
            if num_running_before:
                self.batch_concatenation_count.inc()
        self.batch_current_size.set(stats.num_running_reqs)
        self.batch_input_tokens.set(stats.num_running_tokens)
        self.batch_max_remaining_tokens.set(stats.num_remaining_tokens)
        self.queue_size.set(stats.num_waiting_reqs)
        self.request_preemptions.inc(stats.num_preempted_reqs)
        self.kv_cache_blocks_used.set(stats.num_used_blocks)
        self.prefix_cache_hit_tokens.inc(stats.num_prefix_hit_tokens)
        for out in outputs:
            if out.request_id in methods:
                self.observe_speculation(
                    out.draft_depth, out.num_accepted_tokens, methods[out.request_id]
                )

    def observe_speculation(self, draft_depth: int, num_accepted: int, method: str) -> None:
        """Count one request's speculative step: a tree of longest path `draft_depth` of which
        `num_accepted` drafts were accepted; `method` is "greedy" or "sample"."""
        if draft_depth <= 0:
            return
        self.spec_steps.labels(method).inc()
        self.spec_proposed_tokens.labels(method).inc(draft_depth)
        self.spec_accepted_tokens.labels(method).inc(num_accepted)
        self.spec_tokens_per_step.labels(method).observe(num_accepted + 1)
        for head in range(draft_depth):
            self.spec_head_proposed.labels(method, str(head)).inc()
            if head < num_accepted:
                self.spec_head_accepted.labels(method, str(head)).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
