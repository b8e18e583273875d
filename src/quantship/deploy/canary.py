"""`quantship gate canary`: compare a canary with its baseline on Prometheus, like an Argo
AnalysisRun but runnable from CI or a laptop.

Every round queries each rule for both sides through Prometheus's HTTP API (/api/v1/query) and
checks canary <= baseline * max_ratio + max_delta. A rule that fails more than `failure_limit`
rounds rolls the canary back at once; a rule that never had data on both sides leaves the verdict
inconclusive. Exit codes: 0 promote, 1 roll back, 2 inconclusive.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from string import Template

from quantship.errors import QuantshipError
from quantship.files import read_yaml_file

DEFAULT_RULES = Path(__file__).parent / "canary-rules.yaml"
PROMOTE, ROLLBACK, INCONCLUSIVE = 0, 1, 2
VERDICTS = {PROMOTE: "PROMOTE", ROLLBACK: "ROLL BACK", INCONCLUSIVE: "INCONCLUSIVE"}


@dataclass(frozen=True)
class Rule:
    name: str
    query: str
    max_ratio: float = 1.0
    max_delta: float = 0.0
    description: str = ""

    def limit(self, baseline: float) -> float:
        return baseline * self.max_ratio + self.max_delta

    def render(self, selector: str, window: str) -> str:
        return Template(self.query).substitute(selector=selector, window=window)


@dataclass(frozen=True)
class Rules:
    rules: list[Rule]
    window: str = "2m"
    canary_selector: str | None = None
    baseline_selector: str | None = None


def load_rules(path: str | Path | None = None) -> Rules:
    path = DEFAULT_RULES if path in (None, "default") else Path(path)
    raw = read_yaml_file(path, "canary rules")
    if not isinstance(raw, dict) or not isinstance(raw.get("rules"), list) or not raw["rules"]:
        raise QuantshipError("canary rules need a non-empty 'rules' list", path)
    rules = []
    for i, item in enumerate(raw["rules"]):
        where = f"rules[{i}]"
        if not isinstance(item, dict) or not item.get("name") or not item.get("query"):
            raise QuantshipError(f"{where}: each rule needs a 'name' and a 'query'", path)
        unknown = set(item) - {"name", "query", "max_ratio", "max_delta", "description"}
        if unknown:
            raise QuantshipError(f"{where}.{sorted(unknown)[0]}: unknown field", path)
        if "max_ratio" not in item and "max_delta" not in item:
            raise QuantshipError(f"{where}: give max_ratio and/or max_delta", path)
        if "$selector" not in item["query"]:
            raise QuantshipError(f"{where}.query: must contain $selector", path)
        try:
            rule = Rule(name=str(item["name"]), query=str(item["query"]), max_ratio=float(item.get("max_ratio", 1.0)),
                        max_delta=float(item.get("max_delta", 0.0)), description=str(item.get("description", "")))
        except (TypeError, ValueError):
            raise QuantshipError(f"{where}: max_ratio and max_delta must be numbers", path) from None
        try:
            rule.render("x", "1m")
        except (KeyError, ValueError) as exc:
            raise QuantshipError(f"{where}.query: only $selector and $window may be substituted ({exc})",
                                 path) from None
        rules.append(rule)
    return Rules(rules=rules, window=str(raw.get("window", "2m")), canary_selector=raw.get("canary_selector"),
                 baseline_selector=raw.get("baseline_selector"))


def clean_selector(text: str | None, which: str) -> str:
    if not text or not text.strip().strip("{}").strip():
        raise QuantshipError(f"no {which} selector: give --{which}-selector 'label=\"value\"' or set "
                             f"{which}_selector in the rules file")
    return text.strip().strip("{}").strip()


def query_value(client, url: str, promql: str) -> float | None:
    """The single value of an instant query; None when there is no data (empty result or NaN)."""
    try:
        response = client.get(f"{url.rstrip('/')}/api/v1/query", params={"query": promql})
        body = response.json()
    except Exception as exc:  # httpx transport errors and non-JSON answers alike
        raise QuantshipError(f"Prometheus at {url} did not answer ({type(exc).__name__}: {exc})") from None
    if body.get("status") != "success":
        raise QuantshipError(f"Prometheus rejected the query {promql!r}: {body.get('error', response.status_code)}")
    data = body["data"]
    if data["resultType"] == "scalar":
        values = [data["result"][1]]
    else:
        values = [series["value"][1] for series in data["result"]]
    if len(values) > 1:
        raise QuantshipError(f"query returned {len(values)} series; aggregate it to one value: {promql}")
    if not values:
        return None
    value = float(values[0])
    return None if math.isnan(value) else value


@dataclass
class RuleTally:
    rule: Rule
    passed: int = 0
    failed: int = 0
    no_data: int = 0
    measurements: list[dict] = field(default_factory=list)


@dataclass
class GateResult:
    verdict: int
    reason: str
    tallies: list[RuleTally]

    def to_dict(self) -> dict:
        return {"verdict": VERDICTS[self.verdict], "exit_code": self.verdict, "reason": self.reason,
                "rules": [{"name": t.rule.name, "passed": t.passed, "failed": t.failed, "no_data": t.no_data,
                           "measurements": t.measurements} for t in self.tallies]}


def measure(client, url: str, rule: Rule, canary: str, baseline: str, window: str) -> dict:
    c = query_value(client, url, rule.render(canary, window))
    b = query_value(client, url, rule.render(baseline, window))
    if c is None or b is None:
        return {"canary": c, "baseline": b, "limit": None, "outcome": "no data"}
    limit = rule.limit(b)
    return {"canary": c, "baseline": b, "limit": limit, "outcome": "pass" if c <= limit else "fail"}


def run_gate(url: str, rules: Rules, canary: str, baseline: str, *, interval: float = 60, count: int = 5,
             failure_limit: int = 1, window: str | None = None, report=print) -> GateResult:
    import httpx

    if count < 1 or interval < 0 or failure_limit < 0:
        raise QuantshipError("--count must be >= 1, --interval and --failure-limit >= 0")
    tallies = [RuleTally(r) for r in rules.rules]
    window = window or rules.window
    with httpx.Client(timeout=10.0) as client:
        for n in range(1, count + 1):
            for t in tallies:
                m = measure(client, url, t.rule, canary, baseline, window)
                t.measurements.append(m)
                t.passed += m["outcome"] == "pass"
                t.failed += m["outcome"] == "fail"
                t.no_data += m["outcome"] == "no data"
                report(f"[{n}/{count}] {t.rule.name}: " + _describe(m))
                if t.failed > failure_limit:
                    return GateResult(ROLLBACK, f"{t.rule.name} failed {t.failed} of {n} rounds, "
                                                f"failure limit {failure_limit}", tallies)
            if n < count:
                time.sleep(interval)
    silent = [t.rule.name for t in tallies if t.passed + t.failed == 0]
    if silent:
        return GateResult(INCONCLUSIVE, f"no data for {', '.join(silent)} in {count} round(s)", tallies)
    return GateResult(PROMOTE, f"{len(tallies)} rule(s) held over {count} round(s)", tallies)


def _describe(m: dict) -> str:
    def fmt(v):
        return "none" if v is None else f"{v:.4g}"

    if m["outcome"] == "no data":
        return f"no data (canary {fmt(m['canary'])}, baseline {fmt(m['baseline'])})"
    return f"canary {fmt(m['canary'])} vs limit {fmt(m['limit'])} (baseline {fmt(m['baseline'])}): {m['outcome']}"
