"""From a step's request records to the figures `vllm bench serve --save-result` writes, and a few more.

Definitions follow vLLM's so numbers compare across tools: TTFT from send to the first token-bearing
chunk; TPOT = (E2E latency - TTFT) / (output tokens - 1), per request; ITL = every gap between
successive chunks, all requests pooled; E2EL from send to the stream's end. Percentiles are numpy's
linear interpolation. Goodput counts completed requests meeting every SLO given.
"""

from __future__ import annotations

import re

import numpy as np

from quantship.bench.client import RequestRecord
from quantship.bench.load import StepResult
from quantship.errors import QuantshipError

PERCENTILES = (90, 95, 99)
SLO_NAMES = {"ttft": "ttft", "tpot": "tpot", "e2el": "e2el", "e2e": "e2el"}
_SLO_ITEM = re.compile(r"^\s*([a-z0-9]+)\s*[=:]\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*$")


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft=200ms,tpot=50,e2el=2s' -> {'ttft': 200.0, 'tpot': 50.0, 'e2el': 2000.0}, in milliseconds."""
    if not text:
        return {}
    slo = {}
    for item in text.split(","):
        m = _SLO_ITEM.match(item.lower())
        if not m or m.group(1) not in SLO_NAMES:
            raise QuantshipError(f"--slo: cannot read {item.strip()!r}; write e.g. ttft=200ms,tpot=50ms,e2el=2s "
                                 "(milliseconds unless 's')")
        value = float(m.group(2)) * (1000.0 if m.group(3) == "s" else 1.0)
        if value <= 0:
            raise QuantshipError(f"--slo: {m.group(1)} must be above zero")
        slo[SLO_NAMES[m.group(1)]] = value
    return slo


def describe(name: str, seconds: list[float]) -> dict[str, float | None]:
    """mean, median, std, p90, p95, p99 and max in milliseconds; None when nothing was measured."""
    keys = ["mean", "median", "std", *(f"p{p}" for p in PERCENTILES), "max"]
    if not seconds:
        return {f"{k}_{name}_ms": None for k in keys}
    ms = np.asarray(seconds, dtype=np.float64) * 1000.0
    values = [ms.mean(), np.median(ms), ms.std(), *np.percentile(ms, PERCENTILES), ms.max()]
    return {f"{k}_{name}_ms": round(float(v), 4) for k, v in zip(keys, values)}


def tpot(record: RequestRecord) -> float | None:
    if record.ttft is None or record.output_tokens < 2:
        return None
    return (record.e2el - record.ttft) / (record.output_tokens - 1)


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    measured = {"ttft": record.ttft, "tpot": tpot(record) or 0.0, "e2el": record.e2el}
    return all(measured[k] is not None and measured[k] * 1000.0 <= limit for k, limit in slo.items())


def summarize(result: StepResult, slo: dict[str, float] | None = None) -> dict:
    """One step's figures, vLLM's keys first."""
    step, records = result.step, result.records
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    duration = max(result.duration, 1e-9)
    total_in = sum(r.input_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    failures: dict[str, int] = {}
    for r in failed:
        failures[r.error] = failures.get(r.error, 0) + 1
    out = {
        "label": step.label,
        "profile": step.kind,
        "request_rate": step.rate if step.rate is not None else "inf",  # vLLM writes "inf" for no rate limit
        "burstiness": step.burstiness,
        "max_concurrency": 1 if step.kind == "synchronous" else step.concurrency,
        "duration": round(result.duration, 4),
        "completed": len(ok),
        "failed": len(failed),
        "cancelled": result.cancelled,
        "failures": dict(sorted(failures.items(), key=lambda kv: -kv[1])),
        "error_rate": round(len(failed) / len(records), 6) if records else 0.0,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    if slo:
        good = sum(meets_slo(r, slo) for r in ok)
        out["request_goodput"] = good / duration
        out["goodput_fraction"] = good / len(ok) if ok else 0.0
        out["slo_ms"] = dict(slo)
    out["max_output_tokens_per_s"] = _peak_tokens_per_second(ok)
    out["max_concurrent_requests"] = _peak_in_flight(records)
    out |= describe("ttft", [r.ttft for r in ok])
    out |= describe("tpot", [t for t in map(tpot, ok) if t is not None])
    out |= describe("itl", [gap for r in ok for gap in r.itls])
    out |= describe("e2el", [r.e2el for r in ok])
    out["offered_rate"] = step.rate if step.rate is not None else out["request_throughput"]
    out["send_rate"] = _send_rate(records)
    out |= {f"{k}_send_lag_ms": v for k, v in _lag_ms(records).items()}
    out["output_token_mismatches"] = sum(  # chunks seen vs the server's own count, when it gives one
        1 for r in ok if r.server_output_tokens is not None and r.server_output_tokens != r.chunk_tokens)
    return out


def details(result: StepResult) -> dict:
    """Per-request arrays under vLLM's names (bench.json with --details)."""
    rs = sorted(result.records, key=lambda r: r.index)
    return {"input_lens": [r.input_tokens for r in rs], "output_lens": [r.output_tokens if r.ok else 0 for r in rs],
            "ttfts": [r.ttft or 0.0 for r in rs], "itls": [r.itls for r in rs], "errors": [r.error or "" for r in rs],
            "start_times": [round(r.sent, 6) for r in rs]}


def _peak_tokens_per_second(ok: list[RequestRecord]) -> float:
    times = []
    for r in ok:
        if r.ttft is not None:
            times.extend(np.cumsum([r.sent + r.ttft, *r.itls]))
    if not times:
        return 0.0
    counts = np.bincount(np.floor(np.asarray(times)).astype(np.int64).clip(min=0))
    return float(counts.max())


def _peak_in_flight(records: list[RequestRecord]) -> int:
    # Ends sort before starts at the same instant, so back-to-back requests do not count as overlapping.
    events = sorted([(r.sent, 1) for r in records] + [(r.finished, -1) for r in records])
    level = peak = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return peak


def _send_rate(records: list[RequestRecord]) -> float | None:
    sends = sorted(r.sent for r in records)
    if len(sends) < 2 or sends[-1] <= sends[0]:
        return None
    return (len(sends) - 1) / (sends[-1] - sends[0])


def _lag_ms(records: list[RequestRecord]) -> dict[str, float | None]:
    """How late requests left against the arrival schedule: the generator keeping up, or not."""
    lags = [max(0.0, r.sent - r.scheduled) * 1000.0 for r in records]
    if not lags:
        return {"mean": None, "p99": None}
    return {"mean": round(float(np.mean(lags)), 4), "p99": round(float(np.percentile(lags, 99)), 4)}
