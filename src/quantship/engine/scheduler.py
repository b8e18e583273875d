"""Which sequences run this step, and how many tokens each computes.

Order of service: running decodes (one token each), running prefills (chunks), then waiting
requests by priority class and arrival. When blocks run out the least important running sequence
(lowest class, latest arrival) is preempted: its blocks are freed and it is recomputed later.
"""

from __future__ import annotations

import bisect
import time

from quantship.engine.block_manager import BlockManager
from quantship.engine.config import EngineConfig
from quantship.engine.sequence import Sequence, Status


class QueueFull(Exception):
    """The waiting queue is at its bound: the caller should answer 429 and retry later."""


def rank(seq: Sequence) -> tuple[int, float]:
    """Smaller is more important: higher priority class first, then earlier arrival."""
    return (-seq.priority, seq.metrics.arrival)


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager):
        self.config, self.blocks = config, blocks
        self.waiting: list[Sequence] = []  # kept sorted by rank
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence, bounded: bool = True) -> None:
        if bounded and len(self.waiting) >= self.config.max_waiting:
            raise QueueFull(f"the waiting queue is full ({self.config.max_waiting} requests)")
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        keys = [rank(s) for s in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, rank(seq)), seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq)

    def schedule(self) -> list[tuple[Sequence, int]]:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        protected: set[Sequence] = set()  # already in this step: never preempted for a later one
        ordered = sorted(self.running, key=rank)
        decodes = [s for s in ordered if not s.is_prefilling]
        prefills = [s for s in ordered if s.is_prefilling]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            count = min(seq.num_tokens - seq.num_computed, budget)
            if self._reserve(seq, seq.num_computed + count, protected):
                scheduled.append((seq, count))
                protected.add(seq)
                budget -= count
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            self.blocks.match_prefix(seq)
            count = min(seq.num_tokens - seq.num_computed, budget)
            if not self.blocks.allocate(seq, seq.num_computed + count):
                self.blocks.release(seq)  # wait for blocks; new arrivals never preempt running work
                break
            self.blocks.count_lookup(seq)
            self.waiting.pop(0)
            seq.status = Status.RUNNING
            self.running.append(seq)
            if seq.metrics.first_scheduled is None:
                seq.metrics.first_scheduled = time.monotonic()
            scheduled.append((seq, count))
            budget -= count
        return scheduled

    def _reserve(self, seq: Sequence, tokens: int, protected: set[Sequence]) -> bool:
        """Blocks for seq, preempting less important sequences if needed; False if seq itself yields."""
        while not self.blocks.allocate(seq, tokens):
            victims = [s for s in self.running if s is not seq and s not in protected]
            victim = max(victims, key=rank, default=None)
            if victim is None or rank(victim) < rank(seq):
                self._preempt(seq)  # everything else is more important: seq waits
                return False
            self._preempt(victim)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        self.num_preemptions += 1
        seq.metrics.preemptions += 1
        self._enqueue(seq)  # by rank: it arrived early, so it is near the front
