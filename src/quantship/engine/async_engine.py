"""An asyncio front for the engine: one background thread steps the batch, each request reads its
own queue of outputs. Submitting is synchronous so a server can answer 429 before it starts a stream.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable

from quantship.engine.engine import EngineStats, LLMEngine, QueueFull, RequestOutput
from quantship.engine.sampling import SamplingParams
from quantship.engine.sequence import RequestMetrics

__all__ = ["AsyncEngine", "QueueFull", "RequestOutput", "RequestStream"]


class RequestStream:
    """Outputs of one request, in order. Leaving the `async for` early (client gone) aborts it."""

    def __init__(self, engine: AsyncEngine, request_id: str):
        self.request_id = request_id
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self.finished = False

    def _put(self, output: RequestOutput) -> None:  # called from the engine thread
        self._loop.call_soon_threadsafe(self._queue.put_nowait, output)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                output = await self._queue.get()
                self.finished = output.finished
                yield output
        finally:
            if not self.finished:
                self.abort()

    def abort(self) -> None:
        self._engine.abort(self.request_id)
        self.finished = True


class AsyncEngine:
    def __init__(self, engine: LLMEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self._lock = threading.Lock()  # guards the engine between the stepping thread and submitters
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._listeners: list[Callable[[RequestMetrics], None]] = []
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.accepting = True
        self.last_step = 0.0  # monotonic time of the last loop iteration: /ready checks the loop is alive
        self.error: BaseException | None = None

    # --- life cycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="quantship-engine", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        alive = self._thread is not None and self._thread.is_alive() and self.error is None
        return alive and self.accepting and time.monotonic() - self.last_step < 5.0

    async def shutdown(self, drain: bool = True, timeout: float = 60.0) -> None:
        """Stop accepting; with drain, let in-flight requests finish (up to timeout), then stop the thread."""
        self.accepting = False
        deadline = time.monotonic() + timeout
        while drain and self.has_work() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5.0)

    # --- requests ---------------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, priority: int = 0,
               timeout_s: float | None = None, request_id: str | None = None) -> RequestStream:
        """Queue a request; raises QueueFull (answer 429) or ValueError (bad request) at once."""
        if not self.accepting:
            raise QueueFull("the server is shutting down")
        request_id = request_id or f"req-{next(self._ids)}"
        stream = RequestStream(self, request_id)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            self.engine.add_request(request_id, prompt_ids, params, priority=priority, deadline=deadline)
            self._streams[request_id] = stream
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        with self._lock:
            self.engine.abort(request_id)
            self._streams.pop(request_id, None)
        self._wake.set()

    def has_work(self) -> bool:
        with self._lock:
            return self.engine.has_unfinished()

    def stats(self) -> EngineStats:
        with self._lock:
            return self.engine.stats()

    def add_listener(self, listener: Callable[[RequestMetrics], None]) -> None:
        """Called (from the engine thread) with the metrics of every request that finishes."""
        self._listeners.append(listener)

    # --- the stepping thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self.last_step = time.monotonic()
                with self._lock:
                    busy = self.engine.has_unfinished()
                    outputs = self.engine.step() if busy else []
                    streams = [(self._streams.get(o.request_id), o) for o in outputs]
                    for o in outputs:
                        if o.finished:
                            self._streams.pop(o.request_id, None)
                for stream, output in streams:
                    if stream is not None:
                        stream._put(output)
                    if output.finished and output.metrics is not None:
                        for listener in self._listeners:
                            listener(output.metrics)
                if not busy:
                    # Idle: sleep until a request arrives, waking now and then so /ready stays fresh.
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
        except BaseException as exc:  # surfaced through /ready and to every waiting client
            self.error = exc
            with self._lock:
                pending = list(self._streams.items())
                self._streams.clear()
            for request_id, stream in pending:
                stream._put(RequestOutput.failure(request_id, f"engine error: {exc}"))
            raise
