"""The baseline gate: compare a run with an earlier bench.json and fail on regressions past a tolerance.

Each metric knows its direction (latency lower is better, throughput higher), so a tolerance of 5%
means "may get 5% worse", never "may change 5%". A gate file chooses the metrics and their
tolerances:

    tolerance: 5%              # for metrics listed without their own
    metrics:
      request_throughput: 3%
      p99_ttft_ms: 10%
      median_itl_ms:           # the file's tolerance
      error_rate: {absolute: 0.01}   # rates near zero: an absolute allowance, not a relative one

Baselines may be our bench.json (steps compared in order) or a flat `vllm bench serve
--save-result` file (one step).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from quantship.errors import QuantshipError
from quantship.files import read_yaml_file

HIGHER_IS_BETTER = {"request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
                    "goodput_fraction", "max_output_tokens_per_s", "completed"}
_LATENCY = re.compile(r"^(mean|median|std|max|p\d+(\.\d+)?)_(ttft|tpot|itl|e2el)_ms$")
LOWER_IS_BETTER_EXTRA = {"error_rate", "failed"}
DEFAULT_METRICS = ("request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                   "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms")


@dataclass
class Gate:
    metric: str
    tolerance: float  # a fraction of the baseline value, or an amount when absolute
    absolute: bool = False

    @property
    def higher_is_better(self) -> bool:
        return self.metric in HIGHER_IS_BETTER


@dataclass
class Row:
    step: str
    metric: str
    baseline: float
    current: float
    change: float  # relative, signed; absolute for absolute gates
    allowed: str
    regressed: bool


def is_known(metric: str) -> bool:
    return metric in HIGHER_IS_BETTER or metric in LOWER_IS_BETTER_EXTRA or bool(_LATENCY.match(metric))


def parse_tolerance(text, where: str = "--tolerance") -> float:
    """'5%' -> 0.05; 0.05 -> 0.05. A bare number of 1 or more is refused: 5 could mean 5% or 500%."""
    s = str(text).strip()
    try:
        value = float(s[:-1]) / 100.0 if s.endswith("%") else float(s)
    except ValueError:
        raise QuantshipError(f"{where}: cannot read {s!r}; write e.g. 5% or 0.05") from None
    if not s.endswith("%") and value >= 1:
        raise QuantshipError(f"{where}: {s} is ambiguous; write {s}% or {value / 100:g}")
    if value < 0 or math.isnan(value):
        raise QuantshipError(f"{where}: tolerance must be 0 or more")
    return value


def default_gates(tolerance: float) -> list[Gate]:
    return [Gate(m, tolerance) for m in DEFAULT_METRICS]


def read_gate_file(path: Path, tolerance: float) -> list[Gate]:
    data = read_yaml_file(path, "gate file")
    if not isinstance(data, dict) or not isinstance(data.get("metrics"), dict) or not data["metrics"]:
        raise QuantshipError("expected a mapping with a non-empty 'metrics' mapping", path)
    unknown_keys = set(data) - {"tolerance", "metrics"}
    if unknown_keys:
        raise QuantshipError(f"unknown key(s) {', '.join(sorted(unknown_keys))}; expected tolerance, metrics", path)
    default = parse_tolerance(data["tolerance"], f"{path}: tolerance") if "tolerance" in data else tolerance
    gates = []
    for metric, spec in data["metrics"].items():
        if not is_known(metric):
            raise QuantshipError(f"unknown metric {metric!r} (e.g. p99_ttft_ms, median_itl_ms, request_throughput)",
                                 path)
        where = f"{path}: {metric}"
        if isinstance(spec, dict):
            if set(spec) - {"tolerance", "absolute"} or len(spec) != 1:
                raise QuantshipError(f"{metric}: give either tolerance or absolute", path)
            if "absolute" in spec:
                gates.append(Gate(metric, _absolute(spec["absolute"], where), absolute=True))
            else:
                gates.append(Gate(metric, parse_tolerance(spec["tolerance"], where)))
        else:
            gates.append(Gate(metric, default if spec is None else parse_tolerance(spec, where)))
    return gates


def _absolute(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise QuantshipError(f"{where}: absolute must be a number of 0 or more")
    return float(value)


def read_result(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise QuantshipError(f"cannot read baseline ({exc.strerror})", path) from None
    except ValueError as exc:
        raise QuantshipError(f"baseline is not valid JSON ({exc})", path) from None
    if not isinstance(data, dict) or not (isinstance(data.get("steps"), list) or "request_throughput" in data):
        raise QuantshipError("not a bench result: expected 'steps' (quantship) or 'request_throughput' (vLLM)", path)
    if not all(isinstance(step, dict) for step in steps_of(data)):  # checked now, not after a whole run
        raise QuantshipError("not a bench result: every entry of 'steps' must be an object", path)
    return data


def steps_of(result: dict) -> list[dict]:
    return result["steps"] if isinstance(result.get("steps"), list) else [result]


def compare(baseline: dict, current: dict, gates: list[Gate]) -> list[Row]:
    """Every gated metric of every step, the regressions marked; steps are paired in order."""
    old, new = steps_of(baseline), steps_of(current)
    if len(old) != len(new):
        raise QuantshipError(f"the baseline has {len(old)} step(s) and this run {len(new)}; "
                             "compare runs of the same profile and rates")
    rows = []
    for index, (before, after) in enumerate(zip(old, new)):
        label = str(after.get("label") or f"step {index + 1}")
        for gate in gates:
            a, b = before.get(gate.metric), after.get(gate.metric)
            if not _number(a) or not _number(b):
                continue  # not measured in one of the runs (e.g. TPOT of one-token outputs)
            rows.append(_judge(label, gate, float(a), float(b)))
    if not rows:
        raise QuantshipError("no gated metric appears in both the baseline and this run")
    return rows


def _judge(label: str, gate: Gate, before: float, after: float) -> Row:
    worse = (before - after) if gate.higher_is_better else (after - before)  # > 0 means worse
    if gate.absolute:
        return Row(label, gate.metric, before, after, after - before, f"±{gate.tolerance:g}", worse > gate.tolerance)
    change = (after - before) / abs(before) if before else (0.0 if after == before else math.inf)
    allowed = f"{'-' if gate.higher_is_better else '+'}{gate.tolerance * 100:g}%"
    limit = gate.tolerance * abs(before)
    return Row(label, gate.metric, before, after, change, allowed, worse > limit)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
