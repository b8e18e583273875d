"""What a person watches: a live line per step while it runs, a table of steps at the end, the gate's verdict."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from quantship.bench.client import RequestRecord
from quantship.bench.load import Progress as LoadProgress, Step, StepResult
from quantship.bench.output import change_text, fmt


class LiveProgress(LoadProgress):
    """One rich progress bar per step: requests done of the budget (or seconds of the duration), failures, rate."""

    def __init__(self, console: Console):
        self.bar = Progress(TextColumn("[bold]{task.description:<18}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), TextColumn("{task.fields[status]}"), console=console,
                            refresh_per_second=8)
        self.task = None

    def __enter__(self):
        self.bar.start()
        return self

    def __exit__(self, *exc):
        self.bar.stop()

    def start_step(self, step: Step, total: int | None, duration: float | None) -> None:
        self.ok = self.failed = 0
        self.started = time.perf_counter()
        self.by_time = total is None
        self.task = self.bar.add_task(step.label, total=duration if self.by_time else total, status="")

    def request_done(self, record: RequestRecord) -> None:
        self.ok += record.ok
        self.failed += not record.ok
        elapsed = time.perf_counter() - self.started
        status = f"{self.ok} ok, {self.failed} failed, {self.ok / max(elapsed, 1e-9):.2f} req/s"
        done = min(elapsed, self.bar.tasks[self.task].total) if self.by_time else self.ok + self.failed
        self.bar.update(self.task, completed=done, status=status)

    def end_step(self, result: StepResult) -> None:
        note = " (interrupted)" if result.interrupted else ""
        self.bar.update(self.task, status=f"{self.ok} ok, {self.failed} failed in {result.duration:.1f}s{note}")
        if self.by_time:
            self.bar.update(self.task, completed=self.bar.tasks[self.task].total)


STEP_COLUMNS = [("req/s", "request_throughput"), ("out tok/s", "output_throughput"), ("ok", "completed"),
                ("failed", "failed"), ("TTFT p50", "median_ttft_ms"), ("TTFT p99", "p99_ttft_ms"),
                ("TPOT p50", "median_tpot_ms"), ("TPOT p99", "p99_tpot_ms"), ("ITL p99", "p99_itl_ms"),
                ("E2E p99", "p99_e2el_ms")]


def steps_table(summaries: list[dict], title: str, width: int = 200) -> Table:
    """One row per step; on a narrow terminal one column per step, so numbers are never cut."""
    goodput = bool(summaries) and "request_goodput" in summaries[0]
    cols = STEP_COLUMNS + ([("goodput/s", "request_goodput")] if goodput else [])
    table = Table(title=title, caption="latencies in ms")
    if width >= 130:
        table.add_column("step")
        for name, _ in cols:
            table.add_column(name, justify="right")
        for s in summaries:
            table.add_row(s["label"], *(fmt(s.get(key)) for _, key in cols))
    else:
        table.add_column("")
        for s in summaries:
            table.add_column(s["label"], justify="right")
        for name, key in cols:
            table.add_row(name, *(fmt(s.get(key)) for s in summaries))
    return table


def failure_lines(summaries: list[dict]) -> list[str]:
    return [f"{s['label']}: " + ", ".join(f"{reason} x{n}" for reason, n in s["failures"].items())
            for s in summaries if s["failures"]]


def comparison_table(rows: list, baseline: str) -> Table:
    table = Table(title=f"against {baseline}")
    for name in ("step", "metric", "baseline", "now", "change", "allowed", "verdict"):
        table.add_column(name, justify="left" if name in ("step", "metric", "verdict") else "right")
    for r in rows:
        verdict = "[red]REGRESSED[/red]" if r.regressed else "ok"
        table.add_row(r.step, r.metric, fmt(r.baseline), fmt(r.current), change_text(r), r.allowed, verdict)
    return table
