"""Turn an engine RequestStream into OpenAI responses: one JSON body, or server-sent events.

Both paths cancel the request when the client goes away: the SSE generator is cancelled by
Starlette on disconnect (leaving `async for` aborts the request); the JSON path races the
generation against the client's `http.disconnect` message.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.requests import Request

from quantship.engine.async_engine import RequestOutput, RequestStream
from quantship.server.protocol import APIError


@dataclass
class Kind:
    """What differs between /v1/completions and /v1/chat/completions."""

    chat: bool
    request_id: str
    model: str
    logprobs: bool
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def envelope(self, obj: str, choices: list, usage: dict | None = None, with_usage: bool = False) -> dict:
        body = {"id": self.request_id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None or with_usage:
            body["usage"] = usage
        return body


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def logprobs_block(kind: Kind, tokenizer, token_ids: list[int], logprobs: list[float], offset: int = 0) -> dict:
    """Chosen tokens' log-probabilities in each endpoint's shape (no alternatives are computed)."""
    tokens = [tokenizer.decode([t]) for t in token_ids]
    if kind.chat:
        return {"content": [{"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []}
                            for tok, lp in zip(tokens, logprobs)]}
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": logprobs,
            "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, logprobs)], "text_offset": offsets}


def _engine_error(message: str | None) -> APIError:
    return APIError(500, message or "the engine failed", type="internal_server_error", code="engine_error")


def _stopped(output: RequestOutput) -> bool:
    """Aborted by a server that stopped before the request finished (an abort for a client that left has no error)."""
    return output.finish_reason == "abort" and output.error is not None


def _shutting_down(message: str) -> APIError:
    return APIError(503, message, type="service_unavailable", code="shutting_down")


async def _wait_for_disconnect(request: Request) -> None:
    # Once the body is read, the next ASGI message is http.disconnect: when the client leaves
    # (or, for a completed response, when the server is done with it).
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def complete(kind: Kind, stream: RequestStream, request: Request, tokenizer) -> dict | None:
    """Collect the whole answer; None when the client disconnected first (the request is aborted)."""
    text, token_ids, logprobs, last = [], [], [], None

    async def consume():
        nonlocal last
        async for out in stream:
            text.append(out.text)
            token_ids.extend(out.new_token_ids)
            logprobs.extend(out.logprobs)
            last = out

    consumer = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not consumer.done():  # client gone (or this handler cancelled): stop generating now
            consumer.cancel()
            stream.abort()
    if consumer.cancelled() or not consumer.done():
        return None
    consumer.result()
    if last is None or last.finish_reason == "error":
        raise _engine_error(last.error if last else None)
    if _stopped(last):
        raise _shutting_down(last.error)
    answer = "".join(text)
    lp = logprobs_block(kind, tokenizer, token_ids, logprobs) if kind.logprobs else None
    if kind.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": answer}, "logprobs": lp,
                  "finish_reason": last.finish_reason}
    else:
        choice = {"index": 0, "text": answer, "logprobs": lp, "finish_reason": last.finish_reason}
    return kind.envelope("chat.completion" if kind.chat else "text_completion", [choice],
                         usage(last.prompt_tokens, last.completion_tokens))


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def stream_events(kind: Kind, stream: RequestStream, tokenizer) -> AsyncIterator[str]:
    """SSE chunks in OpenAI's format, then the usage chunk when asked for, then [DONE]."""
    offset, last = 0, None
    try:
        if kind.chat:
            first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            yield _sse(kind.envelope(kind.object, [first], with_usage=kind.include_usage))
        async for out in stream:
            last = out
            if out.finish_reason == "error" or _stopped(out):
                error = _engine_error(out.error) if out.finish_reason == "error" else _shutting_down(out.error)
                yield _sse(error.body())
                break
            if not (out.text or out.finished or (kind.logprobs and out.new_token_ids)):
                continue  # e.g. half of a multi-byte character: the text comes with the next token
            lp = None
            if kind.logprobs:
                lp = logprobs_block(kind, tokenizer, out.new_token_ids, out.logprobs, offset)
            offset += len(out.text)
            if kind.chat:
                choice = {"index": 0, "delta": {"content": out.text} if out.text else {}, "logprobs": lp,
                          "finish_reason": out.finish_reason}
            else:
                choice = {"index": 0, "text": out.text, "logprobs": lp, "finish_reason": out.finish_reason}
            yield _sse(kind.envelope(kind.object, [choice], with_usage=kind.include_usage))
        if kind.include_usage and last is not None and last.finish_reason != "error" and not _stopped(last):
            yield _sse(kind.envelope(kind.object, [], usage(last.prompt_tokens, last.completion_tokens)))
        yield _sse("[DONE]")
    finally:
        if not stream.finished:  # the client left (a cancelled or closed generator lands here)
            stream.abort()
