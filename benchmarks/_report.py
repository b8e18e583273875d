"""Benchmarks write their JSON under benchmarks/results/ and their table into a section of BENCHMARKS.md."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BENCHMARKS_MD = ROOT / "BENCHMARKS.md"


def write_result(name: str, data: dict, folder: str | Path = RESULTS) -> Path:
    """data as folder/NAME.json (benchmarks/results/ unless given), the folder made if needed."""
    path = Path(folder) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def write_run(folder: str | Path, name: str, data: dict) -> Path:
    """A run's result as folder/NAME.json (on the GPU machine $OUT; write_result), its path printed."""
    out = write_result(name, data, folder)
    print(f"wrote {out}")
    return out


def registered(paths: list[str]):
    """Each result file's data, copied into benchmarks/results/ under its name as it is rendered."""
    for path in paths:
        r = json.loads(Path(path).read_text())
        write_result(Path(path).stem, r)
        yield r


def update_section(name: str, markdown: str) -> None:
    """Replace (or append) the block between <!-- name:start --> and <!-- name:end --> markers."""
    text = BENCHMARKS_MD.read_text() if BENCHMARKS_MD.exists() else "# Benchmarks\n"
    block = f"<!-- {name}:start -->\n{markdown.rstrip()}\n<!-- {name}:end -->"
    pattern = re.compile(rf"<!-- {re.escape(name)}:start -->.*?<!-- {re.escape(name)}:end -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    BENCHMARKS_MD.write_text(text)


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def run_or_render(doc: str, add_run_arguments, run, render) -> None:
    """The two commands of a benchmark script: `run` (its arguments added by add_run_arguments(parser),
    run(args) called) and `render PATHS` (result files into BENCHMARKS.md)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_run_arguments(sub.add_parser("run"))
    sub.add_parser("render").add_argument("paths", nargs="+")
    args = ap.parse_args()
    if args.cmd == "render":
        render(args.paths)
    else:
        run(args)
