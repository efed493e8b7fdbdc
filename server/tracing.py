"""OpenTelemetry traces of requests (TGIS's OTLP_ENDPOINT / OTLP_SERVICE_NAME settings).

Each RPC gets a SERVER span named after its gRPC method (``fmaas.GenerationService/Generate``),
child of the W3C trace context the client sent in its metadata (``traceparent``), if any; each
request of the OpenAI-compatible HTTP API one named after its route
(``POST /v1/chat/completions``), child of its ``traceparent`` header. Each
generated sequence of a Generate or GenerateStream call gets a child span ``sequence``, written
once it completes, that starts at the request's arrival and carries:

- attributes: ``input_tokens``, ``generated_tokens``, ``max_new_tokens``, ``stop_reason``,
  ``decoding_method``, ``seed``, and the timings in seconds ``queue_time_s`` (arrival to first
  engine step), ``prefill_time_s`` (first step to first token), ``decode_time_s`` (first token to
  the last), ``inference_time_s`` (first step to the last token), ``time_per_token_s``
  (inference time / generated tokens, TGIS's) and ``total_time_s``;
- events ``scheduled`` (first engine step) and ``first_token``.

Without an endpoint nothing is set up: the servicer's `RequestTracer` is None, its spans are the
API's non-recording INVALID_SPAN, and the SDK and exporter are never imported.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

SERVICE_NAME_DEFAULT = "specserve"
SHUTDOWN_EXPORT_S = 3.0
"""At shutdown, pending spans get this long to reach the collector."""
Metadata = Sequence[tuple[str, str | bytes]]


@dataclass(frozen=True)
class SequenceRecord:
    """One completed sequence, protobuf-free. Instants are `time.monotonic()` values: `arrival`
    of the RPC, `started` and `first_token` (the engine's first SCHEDULED and FIRST_TOKEN
    events of the request, None when it never got that far) and `end`."""

    index: int
    input_tokens: int
    generated_tokens: int
    max_new_tokens: int
    stop_reason: str
    decoding_method: str
    seed: int
    arrival: float
    started: float | None
    first_token: float | None
    end: float


def _epoch_ns(monotonic: float, now_mono: float, now_ns: int) -> int:
    """A `time.monotonic()` instant as Unix-epoch nanoseconds (what spans carry)."""
    return now_ns - int((now_mono - monotonic) * 1e9)


class RequestTracer:
    """Creates the request spans on `tracer`; `shutdown()` flushes and stops `provider` (the
    SDK TracerProvider that owns the exporter), if given."""

    def __init__(self, tracer: trace.Tracer, provider: Any | None = None) -> None:
        self.tracer = tracer
        self.provider = provider

    @contextlib.contextmanager
    def rpc(self, method: str, metadata: Metadata | None) -> Iterator[Span]:
        """A span around one RPC of `fmaas.GenerationService` (not made current: handlers run
        as async generators too). An exception leaving the block marks it ERROR, and is recorded
        unless it is a cancellation."""
        attributes = {
            "rpc.system": "grpc",
            "rpc.service": "fmaas.GenerationService",
            "rpc.method": method,
        }
        with self._server_span(f"fmaas.GenerationService/{method}", attributes, metadata) as span:
            yield span

    @contextlib.contextmanager
    def http(self, route: str, headers: Metadata | None) -> Iterator[Span]:
        """A span around one ``POST`` to `route` of the HTTP API, as `rpc` for an RPC (the
        client's ``traceparent`` header is its parent)."""
        attributes = {"http.request.method": "POST", "http.route": route}
        with self._server_span(f"POST {route}", attributes, headers) as span:
            yield span

    @contextlib.contextmanager
    def _server_span(
        self, name: str, attributes: dict[str, str], metadata: Metadata | None
    ) -> Iterator[Span]:
        carrier = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
        parent = propagate.extract(carrier)
        span = self.tracer.start_span(
            name, context=parent, kind=SpanKind.SERVER, attributes=attributes
        )
        if "x-correlation-id" in carrier:
            span.set_attribute("correlation_id", carrier["x-correlation-id"])
        try:
            yield span
        except Exception as e:
            span.record_exception(e)
            span.set_status(Status(StatusCode.ERROR, f"{type(e).__name__}: {e}"))
            raise
        except BaseException as e:  # cancelled: the client went away
            span.set_status(Status(StatusCode.ERROR, f"cancelled ({type(e).__name__})"))
            raise
        finally:
            span.end()

    def sequence(self, parent: Span, record: SequenceRecord) -> None:
        """Write the finished span of one sequence under `parent` (see the module docstring)."""
        now_mono, now_ns = time.monotonic(), time.time_ns()

        def ns(instant: float) -> int:
            return _epoch_ns(instant, now_mono, now_ns)

        r = record
        attributes: dict[str, Any] = {
            "sequence.index": r.index,
            "input_tokens": r.input_tokens,
            "generated_tokens": r.generated_tokens,
            "max_new_tokens": r.max_new_tokens,
            "stop_reason": r.stop_reason,
            "decoding_method": r.decoding_method,
            "seed": r.seed,
            "total_time_s": r.end - r.arrival,
        }
        if r.started is not None:
            inference = r.end - r.started
            attributes["queue_time_s"] = r.started - r.arrival
            attributes["inference_time_s"] = inference
            if r.generated_tokens:
                attributes["time_per_token_s"] = inference / r.generated_tokens
        if r.started is not None and r.first_token is not None:
            attributes["prefill_time_s"] = r.first_token - r.started
            attributes["decode_time_s"] = r.end - r.first_token
        span = self.tracer.start_span(
            "sequence",
            context=trace.set_span_in_context(parent),
            start_time=ns(r.arrival),
            attributes=attributes,
        )
        if r.started is not None:
            span.add_event("scheduled", timestamp=ns(r.started))
        if r.first_token is not None:
            span.add_event("first_token", timestamp=ns(r.first_token))
        span.end(end_time=ns(r.end))

    def shutdown(self, timeout_s: float = SHUTDOWN_EXPORT_S) -> None:
        """Export what is pending and stop the provider (no-op without one), waiting at most
        `timeout_s`: an unreachable collector (the exporter retries) must not hold up the
        server's exit; what is not exported by then is dropped."""
        if self.provider is not None:
            done = threading.Thread(
                target=self.provider.shutdown, name="otlp-shutdown", daemon=True
            )
            done.start()
            done.join(timeout_s)


@contextlib.contextmanager
def http_span(tracer: RequestTracer | None, route: str, headers: Metadata | None) -> Iterator[Span]:
    """`tracer.http(...)`, or the non-recording INVALID_SPAN without a tracer."""
    if tracer is None:
        yield trace.INVALID_SPAN
        return
    with tracer.http(route, headers) as span:
        yield span


@contextlib.contextmanager
def rpc_span(
    tracer: RequestTracer | None, method: str, metadata: Metadata | None
) -> Iterator[Span]:
    """`tracer.rpc(...)`, or the non-recording INVALID_SPAN without a tracer."""
    if tracer is None:
        yield trace.INVALID_SPAN
        return
    with tracer.rpc(method, metadata) as span:
        yield span


def start_tracing(endpoint: str, service_name: str | None) -> RequestTracer:
    """A tracer exporting in batches over OTLP/gRPC to `endpoint` (``http://`` for plaintext).
    `service_name` None: OTEL_SERVICE_NAME if set, else ``specserve``. Raises RuntimeError when
    the OpenTelemetry SDK or its OTLP exporter (the ``otel`` extra) is not installed."""
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        raise RuntimeError(
            f"OTLP_ENDPOINT is set but the OpenTelemetry SDK or its OTLP exporter is not "
            f"installed ({e}): pip install 'specserve[otel]', or unset OTLP_ENDPOINT"
        ) from e

    resource = Resource.create({SERVICE_NAME: service_name} if service_name else {})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: SERVICE_NAME_DEFAULT}))
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return RequestTracer(provider.get_tracer("specserve"), provider)
