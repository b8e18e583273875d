"""Command-line values checked where they enter: argparse types with ranges, and a parser whose
errors are one line. A number out of range is refused while parsing, before any model loads, so a
typo costs a second instead of a model load followed by a traceback deep in torch."""

from __future__ import annotations

import argparse
import math
import re

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what torch's generators and vLLM's API take as a seed


class OneLineParser(argparse.ArgumentParser):
    """argparse prints the whole usage block before an error; scripts and CI logs want the one line."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _span(lo, hi, lo_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f"in ({lo}, {hi}]" if lo_open else f"in {lo}..{hi}"
    if lo is not None:
        return f"> {lo}" if lo_open else f">= {lo}"
    return f"<= {hi}"


def integer(lo: int | None = None, hi: int | None = None):
    """An int in [lo, hi] (either end open when None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be an integer {_span(lo, hi)}, got {text}")
        return value

    return parse


def number(lo: float | None = None, hi: float | None = None, lo_open: bool = False):
    """A finite float in [lo, hi], or (lo, hi] with lo_open. float() takes 'nan' and 'inf'; nothing here wants them."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        below = lo is not None and (value <= lo if lo_open else value < lo)
        if not math.isfinite(value) or below or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be a finite number {_span(lo, hi, lo_open)}, got {text}")
        return value

    return parse


def module_pattern(text: str) -> str:
    """A compressed-tensors target: a module name, or 're:' and a regular expression that compiles."""
    if text.startswith("re:"):
        try:
            re.compile(text[3:])
        except re.error as exc:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid regular expression ({exc})") from None
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty pattern matches nothing")
    return text


def token_counts(text: str) -> tuple[int, ...]:
    """Comma-separated positive token counts: 4096,8192,32768 (4k and 32K are read as 4096 and 32768)."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        scale = 1024 if part.endswith("k") else 1
        try:
            value = int(part[:-1] if scale > 1 else part) * scale
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected token counts like 4096,8192, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"token counts must be positive, got {text!r}")
        out.append(value)
    return tuple(out)


SEED = integer(INT64_MIN, INT64_MAX)
POSITIVE_FLOAT = number(0, lo_open=True)
POSITIVE = integer(1)
PORT = integer(0, 65535)

