"""`bench --otlp-endpoint`: a CLIENT span per request, its context sent as a W3C `traceparent`, so a
traced server's request span becomes its child and both ends of a slow request are one trace."""

from __future__ import annotations

from quantship.server.tracing import make_provider


class ClientTracer:
    def __init__(self, provider):
        from opentelemetry.trace import SpanKind, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer = provider.get_tracer("quantship.bench")
        self.propagator = TraceContextTextMapPropagator()
        self._kind, self._in_context = SpanKind.CLIENT, set_span_in_context

    def start(self, url: str, record) -> tuple[object, dict[str, str]]:
        """The request's span, and the headers that carry it to the server."""
        span = self.tracer.start_span("POST /v1/completions", kind=self._kind,
                                      attributes={"http.request.method": "POST", "url.full": url,
                                                  "quantship.bench.index": record.index})
        headers: dict[str, str] = {}
        self.propagator.inject(headers, context=self._in_context(span))
        return span, headers

    def end(self, span, record) -> None:
        from opentelemetry.trace import Status, StatusCode

        attributes = {"gen_ai.usage.output_tokens": record.output_tokens}
        if record.ttft is not None:
            attributes["gen_ai.latency.time_to_first_token"] = record.ttft
        span.set_attributes(attributes)
        if record.error is not None:
            span.set_status(Status(StatusCode.ERROR, record.error))
        span.end()

    def shutdown(self) -> None:
        self.provider.shutdown()


def build_client_tracer(endpoint: str | None) -> ClientTracer | None:
    return ClientTracer(make_provider(endpoint, "quantship-bench")) if endpoint else None
