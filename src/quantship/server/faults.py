"""Deliberate faults for canary drills: added latency and a share of failed answers on /v1/*.

A canary gate is only trusted once it has been seen to roll back a bad release; these let a
test (or a staging cluster) start a server that is measurably worse than its baseline.
"""

from __future__ import annotations

import asyncio

from fastapi.responses import JSONResponse

from quantship.server.protocol import error_body


class FaultInjector:
    """Plain ASGI inside the request counter: the delay lands before the first byte (it shows in TTFT
    and E2E), and an injected failure is a 500 that the metrics count like any other.

    Failures are spread evenly, not drawn at random (with rate 0.2: the 5th, 10th, 15th... request),
    so a drill fails exactly its share and a client's first request gets through."""

    def __init__(self, app, latency_s: float = 0.0, error_rate: float = 0.0):
        self.app, self.latency_s, self.error_rate = app, latency_s, error_rate
        self.seen = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope.get("path", "").startswith("/v1/") or scope["path"] == "/v1/models":
            return await self.app(scope, receive, send)
        if self.latency_s > 0:
            await asyncio.sleep(self.latency_s)
        self.seen += 1
        if int(self.seen * self.error_rate) > int((self.seen - 1) * self.error_rate):
            body = error_body("injected fault (--inject-error-rate)", "internal_server_error", code="injected_fault")
            return await JSONResponse(body, 500)(scope, receive, send)
        return await self.app(scope, receive, send)
