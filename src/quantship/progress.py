"""Progress as the command line draws it. Library calls report steps through a callback,
`step(name, total, done=0)` to begin a stage and `step()` per unit done; they never draw."""

from __future__ import annotations

import contextlib
import time


def progress_lines(console, every_s: float = 10.0):
    """(context, step): progress as plain lines, at most one per every_s per stage. With output redirected
    (a log, CI) a bar prints nothing, and minutes of silence look like a hang."""
    state = {"name": "", "total": 0, "done": 0, "shown": 0.0}

    def step(name=None, total=None, done=0):
        now = time.monotonic()
        if name is not None:
            state.update(name=name, total=total, done=done, shown=now)
            console.print(f"{name}: {done}/{total}", highlight=False)
            return
        state["done"] += 1
        if state["done"] == state["total"] or now - state["shown"] >= every_s:
            state["shown"] = now
            console.print(f"{state['name']}: {state['done']}/{state['total']}", highlight=False)

    return contextlib.nullcontext(), step


def progress_bar(console):
    """(context, step): a transient rich bar per stage (verify), or lines when not on a terminal."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    if not console.is_terminal:
        return progress_lines(console)
    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                   console=console, transient=True)
    return _driven(bar)


def layer_bar():
    """(context, step): quantize's bar over decoder layers, on stdout, left on screen when done."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("layers"),
                   TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), transient=False)
    return _driven(bar)


def _driven(bar):
    """(context, step) for a rich Progress. The bar shows from the first stage on (a call that fails before
    any, on bad input, draws nothing) and stops when the context ends."""
    state = {}

    def step(name=None, total=None, done=0):
        if name is not None:
            if not state:
                bar.start()
            state["task"] = bar.add_task(name, total=total, completed=done)
        else:
            bar.advance(state["task"])

    @contextlib.contextmanager
    def shown():
        try:
            yield
        finally:
            if state:
                bar.stop()

    return shown(), step
