"""An asyncio front for the engine: one background thread owns the engine and steps the batch; each
request reads its own queue of outputs.

Submitting validates and bounds the queue at once (so a server answers 400/429 before it starts a
stream) and hands the request to the stepping thread through an inbox: the event loop never waits
for a step to finish.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

from quantship.engine.engine import EngineStats, LLMEngine, QueueFull, RequestOutput
from quantship.engine.sampling_params import SamplingParams
from quantship.engine.sequence import RequestMetrics

__all__ = ["AsyncEngine", "QueueFull", "RequestOutput", "RequestStream", "ShuttingDown"]

log = logging.getLogger(__name__)

# Steps failing one after the other: a broken engine (/ready turns false), not one unlucky batch.
MAX_FAILED_STEPS = 3

# /ready turns false when one step has run this long: a hung engine, not a slow prefill.
STUCK_STEP_S = 120.0


class ShuttingDown(QueueFull):
    """The engine no longer accepts requests (SIGTERM drain): answer 503."""


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
        self._inbox: deque[tuple] = deque()  # requests for the stepping thread to add
        self._aborts: deque[str] = deque()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._streams_lock = threading.Lock()
        self._listeners: list[Callable[[RequestMetrics], None]] = []
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.accepting = True
        self.step_started: float | None = None  # set while a step runs: /ready spots a hung engine
        self.error: BaseException | None = None
        # The stepping thread replaces this after every step; readers get one consistent snapshot.
        self._stats: EngineStats = engine.stats()

    # --- life cycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="quantship-engine", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        alive = self._thread is not None and self._thread.is_alive() and self.error is None
        started = self.step_started
        stuck = started is not None and time.monotonic() - started > STUCK_STEP_S
        return alive and self.accepting and not stuck

    async def shutdown(self, drain: bool = True, timeout: float = 60.0) -> None:
        """Stop accepting; with drain, let in-flight requests finish (up to timeout), then stop the
        thread. Requests still unfinished then get a final "abort" output, so no client waits on."""
        self.accepting = False
        deadline = time.monotonic() + timeout
        while drain and self.has_work() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)
        with self._streams_lock:
            left, self._streams = list(self._streams.items()), {}
        for request_id, stream in left:  # the error tells the server to answer 503, not a truncated 200
            stream._put(RequestOutput(request_id, finished=True, finish_reason="abort",
                                      error="the server stopped before this request finished"))

    # --- requests (event loop side) ---------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, priority: int = 0,
               timeout_s: float | None = None, request_id: str | None = None,
               arrival: float | None = None) -> RequestStream:
        """Queue a request. Raises ValueError (bad request), QueueFull (429) or ShuttingDown (503) at once.

        arrival: when the request reached the server (time.monotonic()); latencies count from it."""
        if not self.accepting:
            raise ShuttingDown("the server is shutting down")
        self.engine.check_request(prompt_ids, params)
        # Reading the queue length without the engine thread's cooperation can be off by the few
        # requests in transit; the bound holds to within that.
        bound = self.engine.config.max_waiting
        if len(self.engine.scheduler.waiting) + len(self._inbox) >= bound:
            raise QueueFull(f"the waiting queue is full ({bound} requests)")
        request_id = request_id or f"req-{next(self._ids)}"
        stream = RequestStream(self, request_id)
        now = arrival if arrival is not None else time.monotonic()
        deadline = None if timeout_s is None else now + timeout_s
        with self._streams_lock:
            # Checked under the lock the failing thread takes to fail every stream: a request either sees
            # the error here or is among the streams failed there, never left waiting.
            if self.error is not None:
                raise ShuttingDown(f"the engine stopped after an error: {self.error}")
            self._streams[request_id] = stream
        self._inbox.append((request_id, list(prompt_ids), params, priority, deadline, now))
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """The request's blocks are freed before the next step runs."""
        with self._streams_lock:
            self._streams.pop(request_id, None)
        self._aborts.append(request_id)
        self._wake.set()

    def has_work(self) -> bool:
        return bool(self._inbox) or self.engine.has_unfinished()

    def stats(self) -> EngineStats:
        """The engine's counters as the stepping thread last left them: all from the same moment between
        two steps (read here, on the event loop, they could mix the step before a change with the one after),
        and never waiting for a step to end."""
        return self._stats

    def expert_tokens(self) -> dict[int, list[int]] | None:
        """Per MoE layer, tokens routed to each expert (serve --expert-stats); read at scrape time. Counters
        only grow, so a read racing a step is at worst a step behind in some layers."""
        return self.engine.runner.expert_tokens()

    def add_listener(self, listener: Callable[[RequestMetrics], None]) -> None:
        """Called (from the engine thread) with the metrics of every request that finishes."""
        self._listeners.append(listener)

    # --- the stepping thread ----------------------------------------------------------------------
    def _take_inbox(self) -> list[RequestOutput]:
        failed = []
        while self._inbox:
            request_id, prompt_ids, params, priority, deadline, arrival = self._inbox.popleft()
            try:
                self.engine.add_request(request_id, prompt_ids, params, priority, deadline, bounded=False,
                                        arrival=arrival)
            except ValueError as exc:
                failed.append(RequestOutput.failure(request_id, str(exc)))
        while self._aborts:
            self.engine.abort(self._aborts.popleft())
        return failed

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            with self._streams_lock:
                stream = self._streams.pop(output.request_id, None) if output.finished else \
                    self._streams.get(output.request_id)
            # Listeners first: when the client sees the end, its metrics and trace are already recorded.
            if output.finished and output.metrics is not None:
                for listener in self._listeners:
                    listener(output.metrics)
            if stream is not None:
                stream._put(output)

    def _run(self) -> None:
        failures = 0
        try:
            while not self._stopping:
                outputs = self._take_inbox()
                self._stats = self.engine.stats()  # new requests count as waiting while the step runs
                if self.engine.has_unfinished():
                    self.step_started = time.monotonic()
                    try:
                        outputs += self.engine.step()
                        failures = 0
                    except Exception as exc:
                        failures += 1
                        if failures >= MAX_FAILED_STEPS:
                            raise
                        log.exception("a step failed: its requests end with an error, the engine goes on")
                        outputs += self._fail_in_flight(exc)
                    finally:
                        self.step_started = None
                self._stats = self.engine.stats()  # before delivery: a client that saw its end sees its counts
                self._deliver(outputs)
                if not self.engine.has_unfinished() and not self._inbox and not self._aborts:
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
        except BaseException as exc:  # surfaced through /ready, to every waiting client and in the log
            log.exception("the engine thread stopped")
            with self._streams_lock:
                self.error = exc
                pending, self._streams = list(self._streams.items()), {}
            for request_id, stream in pending:
                stream._put(RequestOutput.failure(request_id, f"engine error: {exc}"))

    def _fail_in_flight(self, exc: Exception) -> list[RequestOutput]:
        """After a failed step, which sequences it left half-updated is unknown: end every in-flight one with
        the error (their blocks are freed), so the next step starts from a consistent engine."""
        return [RequestOutput.failure(request_id, f"engine error: {exc}") for request_id in self.engine.drop_all()]
