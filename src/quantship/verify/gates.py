"""Gates: thresholds on report metrics that turn a report into pass (exit 0) or fail (exit 1).

A gates file is YAML with a list under `gates`, each an expression `METRIC OP VALUE`:

    gates:
      - kl_mean <= 0.02
      - top1_agreement >= 0.95
      - by_position.kl_p99 <= 0.3      # must hold in every position bin

METRIC is a key of the report's headline, or `by_position.KEY` for a per-bin curve.
"""

from __future__ import annotations

import math
import operator
import re
from pathlib import Path

from quantship.errors import QuantshipError
from quantship.files import read_yaml_file

OPS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt}
_EXPR = re.compile(r"^\s*([A-Za-z0-9_.]+)\s*(<=|>=|<|>)\s*([-+0-9.eE]+)\s*$")
DEFAULTS_DIR = Path(__file__).parent / "gates"


def parse_gates(path: Path) -> list[tuple[str, str, float]]:
    data = read_yaml_file(path, "gates file")
    if not isinstance(data, dict) or not isinstance(data.get("gates"), list) or not data["gates"]:
        raise QuantshipError("expected a non-empty list under 'gates'", path)
    gates = []
    for i, expr in enumerate(data["gates"], 1):
        m = _EXPR.match(str(expr))
        if not m:
            raise QuantshipError(f"gate {i} {expr!r}: expected 'METRIC <=|>=|<|> NUMBER'", path)
        gates.append((m.group(1), m.group(2), float(m.group(3))))
    return gates


def check_metrics(gates: list[tuple[str, str, float]], path: Path) -> None:
    """Refuse a metric the report will not have, before the evaluation rather than after it."""
    from quantship.verify.evaluate import reported_metrics

    headline, positions = reported_metrics()
    for metric, _, _ in gates:
        kind, _, key = metric.partition(".") if metric.startswith("by_position.") else ("", "", metric)
        if key not in (positions if kind else headline):
            known = ", ".join(sorted(headline)) + "; by_position." + ", by_position.".join(sorted(positions))
            raise QuantshipError(f"unknown metric {metric!r} (known: {known})", path)


def default_gates_file(scheme: str | None) -> Path:
    name = (scheme or "W4A16").upper()
    path = DEFAULTS_DIR / f"{name}.yaml"
    return path if path.exists() else DEFAULTS_DIR / "W4A16.yaml"


def evaluate_gates(report: dict, gates: list[tuple[str, str, float]], source: Path) -> dict:
    results = []
    for metric, op, threshold in gates:
        if metric.startswith("by_position."):
            key = metric.split(".", 1)[1]
            curve = report.get("by_position", {}).get(key)
            if curve is None:
                raise QuantshipError(f"unknown metric {metric!r}", source)
            edges = report["by_position"]["bin_edges"]
            bad = [(v, f"positions {lo}-{hi}") for v, lo, hi in zip(curve, edges[:-1], edges[1:])
                   if not math.isnan(v) and not OPS[op](v, threshold)]
            worst = bad[0] if bad else (max(curve) if op in ("<=", "<") else min(curve), None)
            results.append({"metric": metric, "op": op, "threshold": threshold, "value": worst[0],
                            "passed": not bad, "where": worst[1]})
            continue
        value = report.get("headline", {}).get(metric)
        if not isinstance(value, (int, float)):
            raise QuantshipError(f"unknown metric {metric!r}", source)
        results.append({"metric": metric, "op": op, "threshold": threshold, "value": float(value),
                        "passed": bool(OPS[op](value, threshold)), "where": None})
    return {"file": str(source), "passed": all(r["passed"] for r in results), "results": results}
