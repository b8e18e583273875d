"""OpenTelemetry traces of served requests: one span per HTTP request, children for the engine's phases.

Off unless asked for (`--otlp-endpoint`, or the standard OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT
variables): then nothing here is imported and no span is made. When on, the request span starts
in an ASGI middleware (continuing an incoming W3C `traceparent`), and the engine's phases are
written as child spans once the request finishes, from the timings the engine records anyway
(RequestMetrics), so the stepping thread never waits on the tracing SDK:

    POST /v1/completions            gen_ai.usage.*, finish reason, priority, preemptions
      queue                         arrival to first scheduled
      prefill (one per chunk)       the engine step that computed the chunk
      decode                        first token to finish
      detokenize                    first to last detokenization; the busy time as an attribute
"""

from __future__ import annotations

import os
import time
from urllib.parse import urlsplit

from quantship.errors import QuantshipError
from quantship.server.asgi import StatusRecorder

ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def tracing_requested(endpoint: str | None) -> bool:
    """--otlp-endpoint, or an OTLP endpoint in the environment; OTEL_SDK_DISABLED=true and
    OTEL_TRACES_EXPORTER=none turn it off, as they do for every OpenTelemetry SDK."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    return bool(endpoint) or any(os.environ.get(name) for name in ENDPOINT_VARS)


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL for a collector address: like OTEL_EXPORTER_OTLP_ENDPOINT, a base URL
    gets /v1/traces appended; a URL already ending in /v1/traces is kept."""
    parts = urlsplit(endpoint.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise QuantshipError(f"--otlp-endpoint must be an http(s) URL such as http://127.0.0.1:4318, got {endpoint!r}")
    try:
        parts.port
    except ValueError:
        raise QuantshipError(f"--otlp-endpoint has a bad port: {endpoint!r}") from None
    base = endpoint.strip().rstrip("/")
    return base if base.endswith("/v1/traces") else f"{base}/v1/traces"


def make_provider(endpoint: str | None, service_name: str, exporter=None):
    """A TracerProvider batching spans to OTLP/HTTP (protobuf), or to `exporter` (tests)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if exporter is None and protocol and protocol.strip() != "http/protobuf":
        raise QuantshipError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol}: quantship exports traces over "
                             "http/protobuf only")
    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service_name}
    provider = TracerProvider(resource=Resource.create(attributes))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        return provider
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    # No endpoint argument: the exporter reads OTEL_EXPORTER_OTLP_* itself (headers, timeouts too).
    otlp = OTLPSpanExporter(endpoint=traces_url(endpoint)) if endpoint else OTLPSpanExporter()
    provider.add_span_processor(BatchSpanProcessor(otlp))
    return provider


class Clock:
    """Engine timings are time.monotonic(); spans want wall-clock nanoseconds. One fixed offset keeps
    every span of the process on the same scale, so children nest inside parents exactly."""

    def __init__(self):
        self.mono0, self.wall0_ns = time.monotonic(), time.time_ns()

    def ns(self, monotonic: float) -> int:
        return self.wall0_ns + int((monotonic - self.mono0) * 1e9)


class RequestTracer:
    """Makes the spans of served requests; `on_finished` is an AsyncEngine listener."""

    def __init__(self, provider):
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer = provider.get_tracer("quantship.server")
        self.propagator = TraceContextTextMapPropagator()
        self.server_kind = SpanKind.SERVER
        self.clock = Clock()
        self._open: dict[str, object] = {}  # engine request id -> its HTTP request span

    def start_request(self, method: str, path: str, headers: dict[str, str], now: float):
        parent = self.propagator.extract(headers)  # no or malformed traceparent: a new trace
        return self.tracer.start_span(f"{method} {path}", context=parent, kind=self.server_kind,
                                      start_time=self.clock.ns(now),
                                      attributes={"http.request.method": method, "url.path": path})

    def end_request(self, span, status: int, now: float) -> None:
        from opentelemetry.trace import Status, StatusCode

        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
        span.end(end_time=self.clock.ns(now))

    def bind(self, request_id: str, span) -> None:
        """The engine request `request_id` belongs to `span` (before submitting it)."""
        self._open[request_id] = span

    def unbind(self, request_id: str) -> None:
        self._open.pop(request_id, None)

    def on_finished(self, metrics) -> None:
        span = self._open.pop(metrics.request_id, None)
        if span is None:
            return
        from opentelemetry.trace import set_span_in_context

        if span.is_recording():  # a client that left may have ended its span already
            span.set_attributes(self._request_attributes(metrics))
        parent = set_span_in_context(span)
        ns = self.clock.ns
        finished = metrics.finished if metrics.finished is not None else time.monotonic()
        queued_until = metrics.first_scheduled if metrics.first_scheduled is not None else finished
        self._child("queue", parent, ns(metrics.arrival), ns(queued_until))
        for index, (start, end, tokens) in enumerate(metrics.prefill_chunks):
            self._child("prefill", parent, ns(start), ns(end),
                        {"quantship.prefill.chunk": index, "quantship.prefill.tokens": tokens})
        if metrics.first_token is not None:
            self._child("decode", parent, ns(metrics.first_token), ns(finished),
                        {"quantship.decode.tokens": max(metrics.generation_tokens - 1, 0)})
        if metrics.detokenize_first is not None:
            self._child("detokenize", parent, ns(metrics.detokenize_first), ns(metrics.detokenize_last),
                        {"quantship.detokenize.busy_s": metrics.detokenize_s})

    def _child(self, name: str, parent, start_ns: int, end_ns: int, attributes: dict | None = None) -> None:
        span = self.tracer.start_span(name, context=parent, start_time=start_ns, attributes=attributes)
        span.end(end_time=max(end_ns, start_ns))

    @staticmethod
    def _request_attributes(m) -> dict:
        attributes = {"gen_ai.response.id": m.request_id, "gen_ai.usage.input_tokens": m.prompt_tokens,
                      "gen_ai.usage.output_tokens": m.generation_tokens,
                      "gen_ai.response.finish_reasons": [m.finish_reason or "unknown"],
                      "quantship.preemptions": m.preemptions}
        for name, value in (("time_in_queue", m.queue_time), ("time_to_first_token", m.ttft), ("e2e", m.e2e)):
            if value is not None:
                attributes[f"gen_ai.latency.{name}"] = value  # vLLM's attribute names
        return attributes

    def shutdown(self) -> None:
        """Flush what is batched (bounded by the exporter's timeout) and stop."""
        self.provider.shutdown()


class TracingMiddleware:
    """Plain ASGI, like the Gatekeeper: a span around every /v1/* exchange, streams included."""

    def __init__(self, app, tracer: RequestTracer):
        self.app, self.tracer = app, tracer

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1/"):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        span = self.tracer.start_request(scope["method"], path, headers, time.monotonic())
        scope.setdefault("state", {})["otel_span"] = span
        sent = StatusRecorder(send)
        try:
            await self.app(scope, receive, sent)
        finally:
            self.tracer.end_request(span, sent.status, time.monotonic())


def build_request_tracer(endpoint: str | None, service_name: str = "quantship") -> RequestTracer | None:
    """The server's tracer, or None when tracing is off (then no OpenTelemetry module is imported)."""
    if not tracing_requested(endpoint):
        return None
    return RequestTracer(make_provider(endpoint, service_name))
