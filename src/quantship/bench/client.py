"""One streaming completion request, timed on the client: TTFT, every inter-token gap, end to end.

Times are `time.perf_counter()` seconds relative to the start of the step the request belongs to,
so requests of one step share one clock and throughput windows can be computed from them.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from quantship.bench.http1 import Connection, HTTPFailure, Response
from quantship.errors import QuantshipError


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


class Lanes:
    """Keep-alive connections to one server, one per request in flight, reused as requests finish."""

    def __init__(self, url: str):
        self.url = url
        self.path = urlsplit(url).path or "/"
        self.tls = ssl.create_default_context() if url.startswith("https:") else None  # the CA store, loaded once
        self.free: list[Connection] = []
        self.all: list[Connection] = []

    def take(self) -> Connection:
        if self.free:
            return self.free.pop()
        conn = Connection(self.url, self.tls)
        self.all.append(conn)
        return conn

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        for conn in self.all:
            conn.close()


async def stream_completion(lanes: Lanes, payload: dict, record: RequestRecord, t0: float,
                            timeout: float) -> RequestRecord:
    """Send one request and fill `record`; failures become a reason, never an exception."""
    conn = lanes.take()
    body = json.dumps(payload).encode()
    response = None
    record.sent = time.perf_counter() - t0
    try:
        response = await asyncio.wait_for(_exchange(conn, lanes.path, body, record, t0), timeout)
    except asyncio.TimeoutError:
        record.error = "timeout"
    except HTTPFailure as exc:
        record.error = str(exc)
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
        record.error = "connection dropped"
    except OSError:
        record.error = "connection error"
    except ValueError:  # chunk sizes or a status line we cannot read
        record.error = "malformed response"
    finally:
        if conn.release(response):  # cancelled or failed: the connection is closed, never reused
            lanes.free.append(conn)
    record.finished = time.perf_counter() - t0
    record.ok = record.error is None
    return record


async def _exchange(conn: Connection, path: str, body: bytes, record: RequestRecord, t0: float) -> Response:
    response = await conn.post(path, body)
    if response.status != 200:
        record.error = f"HTTP {response.status}"
        record.detail = _error_message(await response.read())
        return response
    events = SSEEvents(record)
    async for piece in response.pieces():
        events.feed(piece, time.perf_counter() - t0)  # stamped on arrival, before any parsing
    if record.ttft is None and record.error is None:
        record.error = "no tokens in stream"
    return response


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
    async with Lanes(url) as lanes:
        return await stream_completion(lanes, payload, RequestRecord(-1, 0.0), time.perf_counter(), timeout)


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
