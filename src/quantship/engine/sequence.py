"""One request as the engine tracks it: tokens, blocks, progress, timings."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from quantship.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """Timings of a finished request (monotonic seconds), what the server's histograms observe."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finish_reason: str | None = None
    request_id: str = ""
    # What a request trace shows beyond the latencies (recorded always: a few appends per request).
    prefill_chunks: list[tuple[float, float, int]] = field(default_factory=list)  # (step start, end, tokens)
    preemptions: int = 0
    detokenize_s: float = 0.0  # time spent turning tokens into text, summed over the steps
    detokenize_first: float | None = None  # the first and last moments detokenization ran
    detokenize_last: float | None = None

    def note_detokenize(self, start: float, end: float) -> None:
        self.detokenize_s += end - start
        if self.detokenize_first is None:
            self.detokenize_first = start
        self.detokenize_last = end

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    @property
    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


class Sequence:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 priority: int = 0, deadline: float | None = None, arrival: float | None = None):
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.token_ids = list(prompt_ids)  # prompt + generated: preemption recomputes all of them
        self.output_ids: list[int] = []  # generated only (read it, never change it: append_token does)
        self.params = params
        self.priority = priority
        self.deadline = deadline  # monotonic time after which the request is dropped
        self.status = Status.WAITING
        self.num_computed = 0  # tokens whose KV entries are in the cache
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the full blocks registered so far
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None
        self.metrics = RequestMetrics(arrival=time.monotonic() if arrival is None else arrival,
                                      prompt_tokens=len(prompt_ids), request_id=request_id)
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator_on(self, device: torch.device) -> torch.Generator | None:
        """The request's seeded random stream on the device its logits live on (None without a seed)."""
        if self.params.seed is None:
            return None
        if device not in self._generators:
            self._generators[device] = torch.Generator(device).manual_seed(self.params.seed)
        return self._generators[device]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def append_token(self, token: int) -> None:
        self.token_ids.append(token)
        self.output_ids.append(token)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < self.num_tokens - 1

    def __repr__(self) -> str:
        return f"Sequence({self.request_id}, {self.status.value}, {self.num_computed}/{self.num_tokens})"
