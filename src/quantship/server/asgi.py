"""Plain-ASGI pieces the middlewares share (the Gatekeeper counts answers, tracing ends spans)."""

from __future__ import annotations


class StatusRecorder:
    """An ASGI `send` that passes every message on and remembers the response status: 500 until the app
    starts a response, which is what the client sees if the app dies before answering."""

    def __init__(self, send):
        self.send, self.status = send, 500

    async def __call__(self, message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        await self.send(message)
