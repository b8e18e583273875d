"""Cold start: from process start to ready and to the first token, by phase.

    process               interpreter start, imports, argument checks, binding the port, the tokenizer
    load_weights          reading the checkpoint into the engine's memory (it has a fixed part too: building
                          the layers imports parts of torch the first time)
    build_cache           sizing and allocating the KV cache, stacking MoE experts for the fused kernels
    capture_cuda_graphs   decode graphs for every batch bucket and one sequence's chunk graphs for every chunk
                          bucket, at the first key-length bucket (CUDA only)
    warmup                one short request through prefill and decode: kernel compilation, cuBLAS
                          handles, int4 decode copies happen here instead of in a client's first token
    serve                 starting the HTTP server, until it answers

The phases add up to the time to ready. `serve` logs them and /metrics exports them as
`quantship:startup_seconds{phase}`, with `quantship:startup_to_ready_seconds` and, once a first token
has been generated, `quantship:startup_to_first_token_seconds` (vLLM exports no start-up metric).
The process start is the kernel's (/proc/self/stat), so the interpreter's own start-up is counted.
"""

from __future__ import annotations

import contextlib
import os
import time

PHASES = ("process", "load_weights", "build_cache", "capture_cuda_graphs", "warmup", "serve")


def process_age() -> float | None:
    """Seconds since this process started, from the kernel (/proc: start time and uptime, both in
    ticks since boot); None where there is no /proc."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22 of stat: starttime
    except (OSError, ValueError, IndexError):
        return None


class StartupClock:
    """Phase durations on the monotonic clock, anchored at the process start."""

    def __init__(self, age: float | None = None):
        """age: seconds since the process started (default: the kernel's; else none, the clock starts now)."""
        age = process_age() if age is None else age
        self.start = time.monotonic() - (age or 0.0)
        self.phases: dict[str, float] = {}
        self._last = self.start
        self.ready_at: float | None = None

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time `name` from the end of the previous phase (so the phases add up); before the first
        one, everything since the process started is `process`."""
        if not self.phases:
            self._last = time.monotonic()
            self.phases["process"] = self._last - self.start
        began = self._last
        try:
            yield
        finally:
            self._last = time.monotonic()
            self.phases[name] = self.phases.get(name, 0.0) + self._last - began

    def mark_ready(self) -> float:
        self.ready_at = time.monotonic()
        self.phases["serve"] = self.ready_at - self._last
        return self.ready_at - self.start

    def since_start(self, monotonic: float | None) -> float | None:
        return None if monotonic is None else monotonic - self.start

    def summary(self) -> str:
        parts = ", ".join(f"{name.replace('_', ' ')} {self.phases.get(name, 0.0):.2f}s" for name in PHASES)
        ready = f"ready {self.ready_at - self.start:.2f}s after the process started" if self.ready_at else "not ready"
        return f"{ready} ({parts})"
