"""Load shapes: how many requests are in flight, and when each one is sent.

A run is a list of steps. `synchronous` sends one request at a time; `concurrent` keeps C in
flight; `constant` and `poisson` send at R requests/s whatever the server does (an open loop, so a
slow server meets a growing queue, as in production); `sweep` first saturates the server to find
its maximum throughput, then climbs a ladder of Poisson rates up to near that maximum, so the
table shows how tail latency grows with load.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from quantship.bench.client import RequestRecord, Session, completion_payload, stream_completion
from quantship.bench.prompts import Prompt

PROFILES = ("synchronous", "concurrent", "constant", "poisson", "sweep")
CAP_REQUESTS = 100_000  # per step, also when a duration bounds it
LADDER_TOP = 0.95  # the sweep's last rung, as a fraction of the measured maximum: at 100% queues never drain


@dataclass
class Step:
    label: str
    kind: str  # synchronous | concurrent | constant | poisson
    rate: float | None = None  # requests/s for constant and poisson
    concurrency: int | None = None  # streams for concurrent; an optional cap on in-flight requests otherwise
    burstiness: float = 1.0  # gamma shape of the gaps: 1 is Poisson, below 1 burstier, above 1 smoother


@dataclass
class Target:
    """Where and what to send; the same for every step of a run."""
    url: str  # the full /v1/completions URL
    model: str
    prompts: list[Prompt]
    output_len: int
    timeout: float  # per request, end to end
    requests: int | None = None  # per step; one of requests and duration bounds a step
    duration: float | None = None
    seed: int = 0
    tracer: object = None  # a bench.tracing.ClientTracer: every request carries a traceparent


@dataclass
class StepResult:
    step: Step
    records: list[RequestRecord] = field(default_factory=list)  # finished requests, ok or failed
    duration: float = 0.0  # step start to the last request's end
    cancelled: int = 0  # in flight when Ctrl-C came; neither completed nor failed
    interrupted: bool = False


class Progress:
    """What the load reports while it runs; the CLI draws it with rich, tests ignore it."""
    def start_step(self, step: Step, total: int | None, duration: float | None) -> None: ...
    def request_done(self, record: RequestRecord) -> None: ...
    def end_step(self, result: StepResult) -> None: ...


def arrival_times(step: Step, seed: int) -> Iterator[float]:
    """Send times in seconds from the step's start; the first request goes at once."""
    if step.kind == "constant":
        yield from (i / step.rate for i in itertools.count())
        return
    rng = np.random.default_rng(seed)
    shape = step.burstiness
    t = 0.0
    while True:
        yield t
        # Gamma gaps with mean 1/rate; shape 1 is the exponential gap of a Poisson process.
        t += float(rng.gamma(shape, 1.0 / (step.rate * shape)))


def ladder(max_rate: float, rungs: int) -> list[float]:
    """Evenly spaced rates from low to LADDER_TOP of the maximum."""
    return [max_rate * LADDER_TOP * (i + 1) / rungs for i in range(rungs)]


async def run_step(target: Target, step: Step, stop: asyncio.Event, progress: Progress | None = None) -> StepResult:
    result = StepResult(step)
    budget = target.requests if target.requests is not None else CAP_REQUESTS  # a duration-bounded step
    progress = progress or Progress()
    progress.start_step(step, target.requests, target.duration)
    cap = step.concurrency if step.kind != "synchronous" else 1
    started = 0
    async with Session(target.url, limit=cap, tracer=target.tracer) as session:
        t0 = time.perf_counter()
        deadline = t0 + target.duration if target.duration else float("inf")
        gate = asyncio.Semaphore(cap) if cap else None

        async def send(index: int, scheduled: float) -> None:
            nonlocal started
            started += 1
            prompt = target.prompts[index % len(target.prompts)]
            payload = completion_payload(target.model, prompt.text, target.output_len)
            record = RequestRecord(index, scheduled, prompt_tokens=prompt.tokens)
            await stream_completion(session, payload, record, t0, target.timeout)
            result.records.append(record)
            progress.request_done(record)

        async def gated(index: int, scheduled: float) -> None:
            async with gate:  # like vLLM's --max-concurrency: arrivals wait here, TTFT starts at the send
                await send(index, scheduled)

        async def closed_loop() -> None:
            counter = itertools.count()

            async def stream() -> None:
                while time.perf_counter() < deadline and (index := next(counter)) < budget:
                    await send(index, time.perf_counter() - t0)

            await asyncio.gather(*(stream() for _ in range(cap)))  # cancelling gather cancels every stream

        async def open_loop() -> None:
            tasks: set[asyncio.Task] = set()
            try:
                for index, due in zip(range(budget), arrival_times(step, target.seed)):
                    if t0 + due > deadline:
                        break
                    # Sleep even when behind schedule (0 s), so responses keep being read.
                    await asyncio.sleep(max(0.0, t0 + due - time.perf_counter()))
                    task = asyncio.create_task(gated(index, due) if gate else send(index, due))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                await asyncio.gather(*tasks)
            finally:  # on Ctrl-C: cancel what is in flight, which closes its connection so the server can stop
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        body = asyncio.create_task(closed_loop() if step.kind in ("synchronous", "concurrent") else open_loop())
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({body, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if not body.done():
            body.cancel()
            await asyncio.gather(body, return_exceptions=True)
            result.interrupted = True
        if not result.interrupted:
            body.result()  # re-raises a bug in the client rather than losing it
        result.cancelled = started - len(result.records)
        result.duration = max([r.finished for r in result.records], default=time.perf_counter() - t0)
    progress.end_step(result)
    return result


async def run_profile(target: Target, profile: str, rates: list[float], concurrency: int | None, burstiness: float,
                      rungs: int, stop: asyncio.Event, progress: Progress | None = None) -> list[StepResult]:
    """All the steps of a profile, in order; stops early (keeping what finished) on Ctrl-C."""
    if profile == "sweep":
        first = Step("max throughput", "concurrent", concurrency=concurrency)
        steps: list[Step] = []
    elif profile in ("constant", "poisson"):
        first = None
        steps = [Step(f"{profile} {r:g}/s", profile, rate=r, concurrency=concurrency, burstiness=burstiness)
                 for r in rates]
    else:
        first = None
        steps = [Step(profile if profile == "synchronous" else f"concurrent {concurrency}", profile,
                      concurrency=concurrency)]
    results = []
    if first is not None:
        results.append(await run_step(target, first, stop, progress))
        peak = sum(r.ok for r in results[0].records) / max(results[0].duration, 1e-9)
        if peak > 0:
            steps = [Step(f"poisson {r:.3g}/s", "poisson", rate=r, burstiness=burstiness) for r in ladder(peak, rungs)]
    for step in steps:
        if stop.is_set():
            break
        results.append(await run_step(target, step, stop, progress))
    return results
