"""The OpenAI-compatible HTTP API over an AsyncEngine: completions, chat, models, health, metrics.

Every failure answers OpenAI's error body {"error": {"message", "type", "param", "code"}}: invalid
requests (bad JSON, wrong types, out-of-range values) 400, unknown model 404, full queue 429 with
Retry-After, shutting down 503. Requests are refused before a stream starts, so a client never
gets a 200 that turns into an error for a reason known up front.
"""

from __future__ import annotations

import asyncio
import hmac
import re
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from quantship.engine.async_engine import AsyncEngine, QueueFull, ShuttingDown
from quantship.server.asgi import StatusRecorder
from quantship.server.faults import FaultInjector
from quantship.server.metrics import ServerMetrics
from quantship.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body
from quantship.server.responses import Kind, complete, stream_events

_TYPE_TAG = re.compile(r"^(str|int|float|bool|list|dict|none)$|[\[\-]")
RETRY_AFTER_S = 1  # a full queue drains in about a request's latency; clients back off and retry


class Gatekeeper:
    """Bearer-token check on /v1/* and counting of /v1/* answers, as plain ASGI so streams and
    disconnects pass straight through (no response buffering)."""

    def __init__(self, app, api_key: str | None, metrics: ServerMetrics):
        self.app, self.api_key, self.metrics = app, api_key, metrics

    def _authorized(self, scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1/"):
            return await self.app(scope, receive, send)
        # Latency histograms start here, as vLLM's start at its API server: parsing, tokenizing and
        # any delay inside the server count toward TTFT and E2E.
        scope.setdefault("state", {})["received_at"] = time.monotonic()
        if self.api_key is not None and not self._authorized(scope):
            body = error_body("missing or wrong API key: send 'Authorization: Bearer <key>'",
                              "invalid_request_error", code="invalid_api_key")
            await JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
            self.metrics.count_response(path, scope["method"], 401)
            return
        sent = StatusRecorder(send)
        try:
            await self.app(scope, receive, sent)
        finally:
            self.metrics.count_response(path, scope["method"], sent.status)


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), err.status, headers=err.headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}", None
    # Drop "body" and the union-branch tags pydantic puts in locations (prompt.str, prompt.list[int]).
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _TYPE_TAG.match(str(p))]
    param = ".".join(loc) or None
    return (f"{param}: {first.get('msg')}" if param else str(first.get("msg", "invalid request"))), param


def create_app(async_engine: AsyncEngine, api_key: str | None = None, metrics: ServerMetrics | None = None,
               served_model_name: str | None = None, faults: dict | None = None,
               request_timeout_s: float | None = None, tracer=None, startup_clock=None,
               checkpoint_bytes: int = 0) -> FastAPI:
    """faults: {"latency_s": .., "error_rate": ..} for canary drills (see server/faults.py).
    request_timeout_s: a request still unfinished this long after arriving is stopped (finish_reason
    "timeout") and its blocks freed, so a stuck queue cannot hold clients forever.
    tracer: a server.tracing.RequestTracer (None: no tracing, no OpenTelemetry import).
    startup_clock: a server.startup.StartupClock whose phases /metrics exports (serve passes it)."""
    engine = async_engine.engine
    tokenizer, max_model_len = engine.tokenizer, engine.max_model_len
    model_name = served_model_name or async_engine.model_name
    metrics = metrics or ServerMetrics(async_engine, model_name, max_model_len, engine.config.enable_prefix_caching,
                                       startup_clock, checkpoint_bytes)
    async_engine.add_listener(metrics.observe)
    app = FastAPI(title="quantship", docs_url=None, redoc_url=None, openapi_url=None)
    started = int(time.time())
    app.state.metrics = metrics
    if faults:
        app.add_middleware(FaultInjector, **faults)  # inside the Gatekeeper: injected 500s are counted
    app.add_middleware(Gatekeeper, api_key=api_key, metrics=metrics)
    app.state.tracer = tracer
    if tracer is not None:
        from quantship.server.tracing import TracingMiddleware

        async_engine.add_listener(tracer.on_finished)
        app.add_middleware(TracingMiddleware, tracer=tracer)  # outermost: refused requests are traced too

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return JSONResponse(error_body(message, "invalid_request_error", param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error", code=exc.status_code),
                            exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):  # logged by Starlette, answered in OpenAI's shape
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "internal_server_error"), 500)

    def check_model(requested: str | None) -> None:
        if requested is not None and requested != model_name:
            raise APIError(404, f"The model `{requested}` does not exist; this server serves `{model_name}`.",
                           param="model", code="model_not_found")

    def resolve_max_tokens(asked: int | None, default: int | None, prompt_len: int) -> int:
        room = max_model_len - prompt_len
        if asked is not None and asked > room:
            raise APIError(400, f"This model's maximum context length is {max_model_len} tokens; the request "
                                f"needs {prompt_len + asked} ({prompt_len} in the prompt, {asked} to generate).",
                           param="max_tokens", code="context_length_exceeded")
        return asked if asked is not None else min(default or room, room)

    async def generate(kind: Kind, body, prompt_ids: list[int], max_tokens: int | None, default_max: int | None,
                       request: Request):
        prompt_param = "messages" if kind.chat else "prompt"
        if len(prompt_ids) >= max_model_len:
            raise APIError(400, f"The prompt has {len(prompt_ids)} tokens; this model's maximum context length is "
                                f"{max_model_len} tokens.", param=prompt_param, code="context_length_exceeded")
        vocab = engine.model.config.vocab_size
        if prompt_ids and not 0 <= min(prompt_ids) <= max(prompt_ids) < vocab:
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param=prompt_param)
        params = body.sampling_params(resolve_max_tokens(max_tokens, default_max, len(prompt_ids)), kind.logprobs)
        if not async_engine.accepting:
            raise APIError(503, "the server is shutting down", type="service_unavailable", code="shutting_down")
        span = getattr(request.state, "otel_span", None)
        if span is not None:
            span.set_attributes({"quantship.priority": body.priority, "gen_ai.request.model": model_name,
                                 "gen_ai.request.max_tokens": params.max_tokens})
            tracer.bind(kind.request_id, span)
        try:
            # vLLM's priority: lower is served first; the engine ranks higher classes first.
            stream = async_engine.submit(prompt_ids, params, priority=-body.priority, request_id=kind.request_id,
                                         arrival=getattr(request.state, "received_at", None),
                                         timeout_s=request_timeout_s)
        except ShuttingDown as exc:  # draining, or the engine thread stopped after an error
            if span is not None:
                tracer.unbind(kind.request_id)
            raise APIError(503, str(exc), type="service_unavailable",
                           code="shutting_down" if not async_engine.accepting else "engine_stopped") from None
        except QueueFull as exc:
            if span is not None:
                tracer.unbind(kind.request_id)
            raise APIError(429, f"{exc}; retry later", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except ValueError as exc:  # what only the engine knows, e.g. a prompt larger than the whole KV cache
            if span is not None:
                tracer.unbind(kind.request_id)
            raise APIError(400, str(exc), param=prompt_param) from None
        if body.stream:
            return StreamingResponse(stream_events(kind, stream, tokenizer), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        answer = await complete(kind, stream, request, tokenizer)
        return JSONResponse(answer) if answer is not None else Response(status_code=499)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        body.refuse_unsupported()
        prompt = body.single_prompt()
        prompt_ids = tokenizer(prompt, verbose=False)["input_ids"] if isinstance(prompt, str) else list(prompt)
        kind = Kind(False, f"cmpl-{uuid.uuid4().hex}", model_name, body.logprobs is not None, body.include_usage)
        return await generate(kind, body, prompt_ids, body.max_tokens, 16, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        body.refuse_unsupported()
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions", param="messages")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in body.messages]
        # The template writes the BOS token itself: tokenize its text without adding specials again.
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # templates raise on conversations they do not accept (jinja errors)
            raise APIError(400, f"the chat template rejected these messages: {exc}", param="messages") from None
        prompt_ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        kind = Kind(True, f"chatcmpl-{uuid.uuid4().hex}", model_name, body.logprobs, body.include_usage)
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await generate(kind, body, prompt_ids, asked, None, request)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": started,
                                            "owned_by": "quantship", "max_model_len": max_model_len}]}

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/ready")
    async def ready():
        if async_engine.ready:
            return {"status": "ready", "model": model_name}
        reason = "shutting down" if not async_engine.accepting else "the engine is not stepping"
        if async_engine.error is not None:
            reason = f"the engine failed: {async_engine.error}"
        return JSONResponse(error_body(reason, "service_unavailable", code="not_ready"), 503)

    @app.get("/metrics")
    async def metrics_endpoint():
        # Rendering walks every histogram: keep it off the event loop that streams tokens.
        body = await asyncio.to_thread(metrics.render)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
