"""A stand-in OpenAI-compatible server with known delays: the yardstick for the load generator.

It answers `/v1/models` and `/v1/completions` (streaming or not). The first token is sent `ttft_ms`
after the request is read and token i at `ttft_ms + i * tpot_ms`: an absolute schedule, so timer
overhead does not pile up into the gaps a test compares against. It always emits `max_tokens`
tokens (as if `ignore_eos` were honoured). Plain asyncio, no framework, so it stays cheap enough
to measure the client's own capacity against it.

    python -m quantship.bench.stub --port 8011 --ttft-ms 50 --tpot-ms 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time

WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta")


class StubServer:
    def __init__(self, ttft_ms: float = 50.0, tpot_ms: float = 10.0, model: str = "stub", fail_every: int = 0):
        self.ttft = ttft_ms / 1000
        self.tpot = tpot_ms / 1000
        self.model = model
        self.fail_every = fail_every  # every Nth completion answers 503, to exercise failure reporting
        self.requests = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # HTTP/1.1 keep-alive: several requests per connection
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                method, path, _ = head[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in head[1:] if ":" in h)}
                body = await reader.readexactly(int(headers.get("content-length", 0) or 0))
                await self.route(method, path.split("?")[0], body, writer)
                if headers.get("connection", "").lower() == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass  # the client hung up, possibly mid-stream: that is its right
        finally:
            writer.close()

    async def route(self, method: str, path: str, body: bytes, writer) -> None:
        if method == "GET" and path == "/v1/models":
            send_json(writer, 200, {"object": "list", "data": [{"id": self.model, "object": "model"}]})
        elif method == "GET" and path == "/health":
            send_json(writer, 200, {})
        elif method == "GET" and path == "/stub/stats":  # lets a test wait until load has really begun
            send_json(writer, 200, {"requests": self.requests})
        elif method == "POST" and path == "/v1/completions":
            self.requests += 1
            req = json.loads(body or b"{}")
            if req.get("model") not in (None, self.model):  # as vLLM does: 404 for a model it does not serve
                send_json(writer, 404, {"error": {"message": f"The model `{req.get('model')}` does not exist.",
                                                  "code": 404}})
            elif self.fail_every and self.requests % self.fail_every == 0:
                send_json(writer, 503, {"error": {"message": "stub: deliberate failure", "code": 503}})
            else:
                await self.complete(req, writer)
        else:
            send_json(writer, 404, {"error": {"message": f"no route {method} {path}", "code": 404}})
        await writer.drain()

    async def complete(self, req: dict, writer) -> None:
        start = time.perf_counter()
        n = int(req.get("max_tokens") or 16)
        prompt = req.get("prompt") or ""
        usage = {"prompt_tokens": len(str(prompt).split()), "completion_tokens": n,
                 "total_tokens": len(str(prompt).split()) + n}  # prompt count is approximate: no tokenizer here
        rid = f"cmpl-stub-{self.requests}"
        if not req.get("stream"):
            await sleep_until(start + self.ttft + self.tpot * (n - 1))
            text = " ".join(WORDS[i % len(WORDS)] for i in range(n))
            send_json(writer, 200, {"id": rid, "object": "text_completion", "model": self.model, "usage": usage,
                                    "choices": [{"index": 0, "text": text, "finish_reason": "length"}]})
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(n):
            await sleep_until(start + self.ttft + i * self.tpot)
            choice = {"index": 0, "text": " " + WORDS[i % len(WORDS)],
                      "finish_reason": "length" if i == n - 1 else None}
            send_chunk(writer, {"id": rid, "object": "text_completion", "model": self.model, "choices": [choice]})
            await writer.drain()
        if (req.get("stream_options") or {}).get("include_usage"):
            send_chunk(writer, {"id": rid, "object": "text_completion", "model": self.model, "choices": [],
                                "usage": usage})
        send_event(writer, b"[DONE]")
        writer.write(b"0\r\n\r\n")  # the chunked body's end


async def sleep_until(deadline: float) -> None:
    # asyncio's epoll waits whole milliseconds rounded up, so sleep(9.6 ms) returns after 10.3 ms and
    # every token would slip ~0.3 ms further behind. Asking for whole milliseconds rounded down keeps
    # each send within about a millisecond of its deadline, early or late, with no drift.
    delay = time.perf_counter() - deadline
    await asyncio.sleep(max(0.0, math.floor(-delay * 1000.0) / 1000.0))


def send_json(writer, status: int, obj: dict) -> None:
    data = json.dumps(obj).encode()
    reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}.get(status, "Error")
    writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)


def send_chunk(writer, obj: dict) -> None:
    send_event(writer, json.dumps(obj).encode())


def send_event(writer, data: bytes) -> None:
    """One server-sent event as one HTTP chunk."""
    event = b"data: " + data + b"\n\n"
    writer.write(b"%x\r\n%s\r\n" % (len(event), event))


async def serve(host: str, port: int, stub: StubServer) -> None:
    server = await asyncio.start_server(stub.handle, host, port, backlog=1024)
    bound = server.sockets[0].getsockname()[1]
    print(f"stub listening on http://{host}:{bound}", flush=True)  # tests read the port from this line
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m quantship.bench.stub", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 = any free port (printed)")
    p.add_argument("--ttft-ms", type=float, default=50.0)
    p.add_argument("--tpot-ms", type=float, default=10.0)
    p.add_argument("--fail-every", type=int, default=0, help="every Nth completion answers 503")
    p.add_argument("--model", default="stub")
    a = p.parse_args(argv)
    try:
        asyncio.run(serve(a.host, a.port, StubServer(a.ttft_ms, a.tpot_ms, a.model, a.fail_every)))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
