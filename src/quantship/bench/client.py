"""One streaming completion request, timed on the client: TTFT, every inter-token gap, end to end.

Times are `time.perf_counter()` seconds relative to the start of the step the request belongs to,
so requests of one step share one clock and throughput windows can be computed from them.

The timed request goes over aiohttp, as in `vllm bench serve`: one `ClientSession` per step whose
connector holds at most as many keep-alive connections as requests may be in flight, and the body
read as it arrives (`resp.content.iter_any()`), each piece stamped before any parsing. httpx stays
for the simple GETs; on the timed path its layers added 1-7 ms to the TTFT seen on a busy 2-core
machine, where aiohttp measures the stub's delays to within about a millisecond.
"""

from __future__ import annotations

import asyncio
import errno
import json
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import aiohttp
import httpx

from quantship import __version__
from quantship.errors import QuantshipError

MAX_ERROR_BODY = 64 * 1024


@dataclass
class RequestRecord:
    index: int
    scheduled: float  # when the arrival profile wanted it sent
    sent: float = 0.0
    finished: float = 0.0
    ok: bool = False
    error: str | None = None  # a short reason that groups well: "HTTP 503", "timeout", "connection refused"
    detail: str | None = None  # the server's own words on an error, for the one message a user reads
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)  # gaps between successive token-bearing chunks
    prompt_tokens: int = 0  # counted with our tokenizer
    server_prompt_tokens: int | None = None  # from the stream's `usage`, when the server sends one
    chunk_tokens: int = 0  # token-bearing chunks seen
    server_output_tokens: int | None = None

    @property
    def e2el(self) -> float:
        return self.finished - self.sent

    @property
    def output_tokens(self) -> int:
        # The server's usage is exact; chunks can merge tokens (vLLM's stream intervals) or be empty.
        return self.server_output_tokens if self.server_output_tokens is not None else self.chunk_tokens

    @property
    def input_tokens(self) -> int:
        return self.server_prompt_tokens if self.server_prompt_tokens is not None else self.prompt_tokens


def completion_payload(model: str, prompt: str, max_tokens: int) -> dict:
    # ignore_eos (vLLM, SGLang, llama.cpp accept it) fixes output lengths, so runs compare like with like.
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}


class Session:
    """One aiohttp session to one server for one step: keep-alive connections, at most `limit` open.

    `limit` is the step's cap on requests in flight (None: no cap, as in an uncapped open loop), so
    each request in flight has its own connection and none waits in aiohttp's pool.
    """

    def __init__(self, url: str, limit: int | None = None, tracer=None):
        self.url = url
        self.limit = limit or 0  # aiohttp's 0 is no limit
        self.tracer = tracer  # a bench.tracing.ClientTracer, or None
        self.http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "Session":
        reuse = aiohttp.TraceConfig()
        reuse.on_connection_reuseconn.append(_mark_reused)
        self.http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.limit),
            # A server that compresses an event stream anyway is inflated; we ask it not to, since a
            # compressor may hold tokens back until its buffer fills.
            auto_decompress=True,
            headers={"User-Agent": f"quantship-bench/{__version__}", "Content-Type": "application/json",
                     "Accept": "text/event-stream", "Accept-Encoding": "identity"},
            trace_configs=[reuse], trust_env=False)  # no proxies, as for the GETs
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.close()

    async def post(self, body: bytes, deadline: float, headers: dict | None = None) -> aiohttp.ClientResponse:
        """POST `body` and return once the status and headers are in, the body still to read.

        A server closes idle keep-alive connections on its own clock (uvicorn after 5 s, llama.cpp's
        cpp-httplib too), and a request sent on one just as it closes is dropped unread. aiohttp sends
        such a request again only for idempotent methods, never for POST: against uvicorn, of 300
        requests each sent 4.985-5.015 s after its connection's previous answer, 55-129 failed with
        "connection dropped", counted against the server although it never saw them. So a request
        that fails before any answer on a *reused* connection is sent once more (0 of 300 failed);
        on a fresh connection a failure is the server's and stands.
        """
        reused = SimpleNamespace(reused=False)
        try:
            return await self.http.post(self.url, data=body, trace_request_ctx=reused, headers=headers,
                                        timeout=_timeout(deadline))
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if not reused.reused or isinstance(exc, aiohttp.ClientConnectorError):
                raise
        return await self.http.post(self.url, data=body, headers=headers, timeout=_timeout(deadline))


async def _mark_reused(session, trace_config_ctx, params) -> None:
    if trace_config_ctx.trace_request_ctx is not None:
        trace_config_ctx.trace_request_ctx.reused = True


def _timeout(deadline: float) -> aiohttp.ClientTimeout:
    # `total` covers the whole exchange, body included: aiohttp raises TimeoutError mid-stream too.
    return aiohttp.ClientTimeout(total=max(deadline - time.perf_counter(), 1e-3))


async def stream_completion(session: Session, payload: dict, record: RequestRecord, t0: float,
                            timeout: float) -> RequestRecord:
    """Send one request and fill `record`; failures become a reason, never an exception."""
    body = json.dumps(payload).encode()
    start = time.perf_counter()
    record.sent = start - t0
    span, headers = session.tracer.start(session.url, record) if session.tracer is not None else (None, None)
    try:
        await _exchange(session, body, record, t0, start + timeout, headers)
    except asyncio.TimeoutError:  # aiohttp's own timeouts are TimeoutErrors too
        record.error = "timeout"
    except aiohttp.ClientSSLError:  # a certificate that does not verify, a handshake that fails
        record.error = "tls error"
    except aiohttp.ClientConnectorError as exc:
        record.error = "connection refused" if isinstance(exc.os_error, ConnectionRefusedError) else "connection error"
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError):  # the payload error: a body cut short
        record.error = "connection dropped"
    except aiohttp.ClientOSError as exc:  # a reset, or a request that could not be written
        record.error = "connection dropped" if _reset(exc) else "connection error"
    except aiohttp.ClientResponseError as exc:  # aiohttp's parser refused the answer (its C and Python parsers
        # word it alike)
        record.error = "not an HTTP answer" if "bad status line" in str(exc.message).lower() else "malformed response"
    except aiohttp.ClientError:
        record.error = "connection error"
    record.finished = time.perf_counter() - t0
    record.ok = record.error is None
    if span is not None:
        session.tracer.end(span, record)
    return record


async def _exchange(session: Session, body: bytes, record: RequestRecord, t0: float, deadline: float,
                    headers: dict | None = None) -> None:
    # Leaving `async with` releases the connection for the next request when the body was read to its
    # end, and closes it otherwise (an error, a timeout, a cancelled task), so the server can stop.
    async with await session.post(body, deadline, headers) as response:
        if response.status != 200:
            record.error = f"HTTP {response.status}"
            error_body = b""
            async for piece in response.content.iter_any():  # to the end, so the connection stays usable
                error_body += piece[: MAX_ERROR_BODY - len(error_body)]
            record.detail = _error_message(error_body)
            return
        events = SSEEvents(record)
        async for piece in response.content.iter_any():  # whatever has arrived, as soon as it has
            events.feed(piece, time.perf_counter() - t0)  # stamped on arrival, before any parsing
    if record.ttft is None and record.error is None:
        record.error = "no tokens in stream"


class SSEEvents:
    """Server-sent events of an OpenAI completion stream, folded into a RequestRecord as they arrive."""

    def __init__(self, record: RequestRecord):
        self.record = record
        self.pending = b""
        self.last: float | None = None

    def feed(self, piece: bytes, now: float) -> None:
        lines = (self.pending + piece).split(b"\n")
        self.pending = lines.pop()  # an unfinished line waits for the next piece
        for line in lines:
            if line.startswith(b"data:"):  # skip blank separators, comments and event: lines
                self.event(line[5:].strip(), now)

    def event(self, data: bytes, now: float) -> None:
        record = self.record
        if data == b"[DONE]" or record.error:
            return  # read on to the body's end regardless: leaving early would cost the keep-alive connection
        try:
            self.fold(json.loads(data), data, now)
        except (ValueError, TypeError, AttributeError, IndexError):
            record.error = "malformed stream"  # JSON of an unexpected shape: one odd answer must not end the run

    def fold(self, chunk: dict, data: bytes, now: float) -> None:
        record = self.record
        if "error" in chunk:
            record.error = "error in stream"
            record.detail = _error_message(data)
            return
        choice = (chunk.get("choices") or [None])[0]  # n = 1: the first choice is the request's
        # A closing chunk with no text but a finish_reason carries no token; counting it would add a
        # near-zero gap to ITL and one token too many.
        if choice and (choice.get("text") or choice.get("finish_reason") is None):
            if self.last is None:
                record.ttft = now - record.sent
            else:
                record.itls.append(now - self.last)
            self.last = now
            record.chunk_tokens += 1
        usage = chunk.get("usage")
        if usage:
            record.server_prompt_tokens = usage.get("prompt_tokens")
            record.server_output_tokens = usage.get("completion_tokens")


def _reset(exc: BaseException | None) -> bool:
    # aiohttp re-raises a write on a closed socket as ClientOSError(None, ...), the reset as its cause.
    while exc is not None:
        if isinstance(exc, ConnectionError) or getattr(exc, "errno", None) in (errno.ECONNRESET, errno.EPIPE):
            return True
        exc = exc.__cause__
    return False


def _error_message(body: bytes) -> str:
    try:
        error = json.loads(body).get("error")
        text = error.get("message") if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        text = None
    text = str(text or body.decode("utf-8", "replace")).strip().replace("\n", " ")
    return text[:200] or "(empty body)"


async def probe_completion(url: str, payload: dict, timeout: float) -> RequestRecord:
    """One short request before the load, so a wrong model name or endpoint fails in a second, clearly."""
    async with Session(url, limit=1) as session:
        return await stream_completion(session, payload, RequestRecord(-1, 0.0), time.perf_counter(), timeout)


def first_model(base_url: str, timeout: float = 10.0) -> str | None:
    """The first id of the server's /v1/models, or None when it has no such route; unreachable is an error."""
    data = _get_json(base_url + "/v1/models", timeout)
    items = (data or {}).get("data") if isinstance(data, dict) else None
    if items and isinstance(items[0], dict) and items[0].get("id"):
        return str(items[0]["id"])
    return None


def _get_json(url: str, timeout: float):
    try:
        response = httpx.get(url, timeout=timeout, trust_env=False)
    except httpx.ConnectError as exc:
        raise QuantshipError(f"cannot reach {url}: {'connection refused' if _refused(exc) else _short(exc)}") from None
    except httpx.TimeoutException:
        raise QuantshipError(f"cannot reach {url}: no answer within {timeout:g}s") from None
    except httpx.HTTPError as exc:
        raise QuantshipError(f"cannot reach {url}: {_short(exc)}") from None
    if response.status_code != 200:
        return None
    try:
        return response.json()
    except ValueError:
        return None


def _refused(exc: BaseException) -> bool:
    # anyio wraps the OSError as "All connection attempts failed"; the cause says what happened.
    while exc is not None:
        if isinstance(exc, ConnectionRefusedError) or "refused" in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _short(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
