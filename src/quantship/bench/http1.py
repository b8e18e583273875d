"""A minimal HTTP/1.1 client for the one timed request: POST a JSON body, read a streamed answer.

Why not httpx here (it stays for the simple GETs): measured on the 2-core development machine while
other work ran, httpx's layers (connection pool, anyio cancel scopes, h11 events) put 1-7 ms between
a token leaving the stub server and the client seeing it, and cost ~1.2 ms of CPU per request; this
plain asyncio stream reader saw the stub's 50 ms TTFT as 50.0 ms under the same load. A load
generator that adds its own latency reports it as the server's.

Covers what OpenAI-compatible servers send (uvicorn, cpp-httplib, hyper, Go net/http): chunked,
Content-Length or close-delimited bodies, keep-alive, https. No redirects, proxies or compression.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import AsyncIterator
from urllib.parse import urlsplit

from quantship import __version__

MAX_ERROR_BODY = 64 * 1024


class HTTPFailure(Exception):
    """A transport failure, already named the way a failure table should show it."""


class Response:
    def __init__(self, conn: "Connection", status: int, headers: dict[str, str]):
        self.conn, self.status, self.headers = conn, status, headers
        self.complete = False  # the body was read to its end, so the connection can carry another request

    async def pieces(self) -> AsyncIterator[bytes]:
        """The body as it arrives: one piece per HTTP chunk (an SSE event, for most servers)."""
        reader = self.conn.reader
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            while True:
                size = int((await reader.readuntil(b"\n")).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while (await reader.readuntil(b"\n")).strip():
                        pass  # trailers, rarely any
                    break
                data = await reader.readexactly(size)
                await reader.readexactly(2)  # the chunk's CRLF
                yield data
        elif "content-length" in self.headers:
            left = int(self.headers["content-length"])
            while left > 0:
                data = await reader.read(min(left, 65536))
                if not data:
                    raise asyncio.IncompleteReadError(b"", left)
                left -= len(data)
                yield data
        else:
            while data := await reader.read(65536):
                yield data
            self.conn.close()  # close-delimited: nothing more can come on this connection
            return
        self.complete = True

    async def read(self) -> bytes:
        body = b""
        async for piece in self.pieces():
            body += piece[: MAX_ERROR_BODY - len(body)]
        return body


class Connection:
    """One keep-alive connection to the server of `url`."""

    def __init__(self, url: str, tls: ssl.SSLContext | None):
        parts = urlsplit(url)
        self.host, self.netloc = parts.hostname, parts.netloc
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.tls = tls if parts.scheme == "https" else None
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> Response:
        reused = self.writer is not None
        if reused and (self.writer.is_closing() or self.reader.at_eof()):
            self.close()  # the server closed it while idle (uvicorn's keep-alive timeout is 5 s)
            reused = False
        try:
            return await self._post(path, body)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            if not reused or getattr(exc, "partial", b""):
                raise
            # Closed by the server just as we reused it: the request was not read, so sending it again
            # on a fresh connection is safe (a load generator that counted this would be counting itself).
            self.close()
            return await self._post(path, body)

    async def _post(self, path: str, body: bytes) -> Response:
        if self.writer is None:
            try:
                self.reader, self.writer = await asyncio.open_connection(
                    self.host, self.port, ssl=self.tls, server_hostname=self.host if self.tls else None,
                    limit=1 << 20)
            except ConnectionRefusedError:
                raise HTTPFailure("connection refused") from None
            except ssl.SSLError:
                raise HTTPFailure("tls error") from None
            except OSError:
                raise HTTPFailure("connection error") from None
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.netloc}\r\nUser-Agent: quantship-bench/{__version__}\r\n"
                f"Content-Type: application/json\r\nAccept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n")
        self.writer.write(head.encode("latin-1") + body)  # one write: headers and body leave together
        status_line = await self.reader.readuntil(b"\n")
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
            raise HTTPFailure("not an HTTP answer")
        headers = {}
        while line := (await self.reader.readuntil(b"\n")).strip():
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if parts[0] == b"HTTP/1.0" or headers.get("connection", "").lower() == "close":
            headers.setdefault("x-close-after", "1")
        return Response(self, int(parts[1]), headers)

    def release(self, response: Response | None) -> bool:
        """Keep the connection for the next request only when this one ended cleanly."""
        if response is None or not response.complete or "x-close-after" in response.headers:
            self.close()
            return False
        return True

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
