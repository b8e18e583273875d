"""bench.json, bench.csv, the PNG plots and bench.html, each written to a temporary name and then renamed.

The rename means a reader (a CI job, a dashboard) never sees half a file, even when Ctrl-C or a full
disk stops the writer. A one-step run also carries that step's figures at the top level, so tools
that read `vllm bench serve --save-result` files read ours unchanged.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
from pathlib import Path

from quantship.errors import QuantshipError
from quantship.files import write_atomic

# Nested or per-request: the CSV gets failures flattened; the SLO and --details arrays stay in bench.json.
CSV_SKIP = {"failures", "slo_ms", "input_lens", "output_lens", "ttfts", "itls", "errors", "start_times"}


def result_document(meta: dict, summaries: list[dict], extra_steps: list[dict] | None = None) -> dict:
    steps = [s | (extra or {}) for s, extra in zip(summaries, extra_steps or [None] * len(summaries))]
    doc = dict(meta)
    if len(steps) == 1:
        doc |= {k: v for k, v in steps[0].items() if k not in doc}
    doc["steps"] = steps
    return doc


def csv_text(summaries: list[dict]) -> str:
    columns = [k for k in summaries[0] if k not in CSV_SKIP] + ["failures"] if summaries else []
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for s in summaries:
        row = {k: ("" if v is None else v) for k, v in s.items()}
        row["failures"] = "; ".join(f"{reason}: {n}" for reason, n in s["failures"].items())
        writer.writerow(row)
    return buf.getvalue()


def html_page(doc: dict, pngs: dict[str, bytes], comparison: list | None) -> str:
    e = html.escape
    meta = [("server", doc.get("base_url")), ("model", doc.get("model_id")), ("profile", doc.get("profile")),
            ("prompts", doc.get("prompt_source")), ("output tokens", doc.get("output_len")), ("date", doc.get("date"))]
    head = "".join(f"<tr><th>{e(k)}</th><td>{e(str(v))}</td></tr>" for k, v in meta if v is not None)
    cols = [("label", "step"), ("request_throughput", "req/s"), ("output_throughput", "out tok/s"),
            ("completed", "done"), ("failed", "failed"), ("median_ttft_ms", "TTFT p50"), ("p99_ttft_ms", "TTFT p99"),
            ("median_tpot_ms", "TPOT p50"), ("p99_tpot_ms", "TPOT p99"), ("p99_itl_ms", "ITL p99"),
            ("p99_e2el_ms", "E2E p99")]
    if doc["steps"] and "request_goodput" in doc["steps"][0]:
        cols.append(("request_goodput", "goodput/s"))
    rows = "".join("<tr>" + "".join(f"<td>{e(fmt(s.get(k)))}</td>" for k, _ in cols) + "</tr>" for s in doc["steps"])
    table = "<tr>" + "".join(f"<th>{e(name)}</th>" for _, name in cols) + "</tr>" + rows
    images = "".join(f'<img alt="{e(name)}" src="data:image/png;base64,{base64.b64encode(data).decode()}">'
                     for name, data in pngs.items())
    gate = ""
    if comparison:
        body = "".join(f"<tr class=\"{'bad' if r.regressed else ''}\"><td>{e(r.step)}</td><td>{e(r.metric)}</td>"
                       f"<td>{fmt(r.baseline)}</td><td>{fmt(r.current)}</td><td>{change_text(r)}</td>"
                       f"<td>{e(r.allowed)}</td></tr>" for r in comparison)
        gate = ("<h2>Against the baseline</h2><table><tr><th>step</th><th>metric</th><th>baseline</th><th>now</th>"
                f"<th>change</th><th>allowed</th></tr>{body}</table>")
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>quantship bench</title><style>
body{{font-family:system-ui,sans-serif;margin:2em;max-width:1100px}} table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}} th{{background:#f3f3f3}} tr.bad td{{background:#fde0e0}}
img{{max-width:100%;display:block;margin:1em 0}}</style></head><body><h1>quantship bench</h1>
<table>{head}</table><h2>Steps</h2><table>{table}</table>{gate}<h2>Plots</h2>{images}</body></html>
"""


def change_text(row) -> str:
    """Relative change as a percentage; an absolute gate's change as the amount itself."""
    return f"{row.change:+.4g}" if row.allowed.startswith("±") else f"{row.change:+.1%}"


def fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.0f}"
    return str(value)


def write_outputs(out_dir: Path, doc: dict, pngs: dict[str, bytes], comparison: list | None) -> list[Path]:
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise QuantshipError(f"cannot create output directory ({exc.strerror})", out_dir) from None
    paths = [write_atomic(out_dir / "bench.json", json.dumps(doc, indent=2) + "\n", "bench result"),
             write_atomic(out_dir / "bench.csv", csv_text(doc["steps"]), "bench table")]
    paths += [write_atomic(out_dir / name, data, "bench plot") for name, data in pngs.items()]
    paths.append(write_atomic(out_dir / "bench.html", html_page(doc, pngs, comparison), "bench page"))
    return paths
