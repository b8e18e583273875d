"""A Grafana dashboard for one served model, as the ConfigMap that Grafana's dashboard sidecar loads
(kube-prometheus-stack: label `grafana_dashboard: "1"`, any namespace the sidecar searches).

Every panel reads the metrics `quantship serve` and vLLM both export (vllm:* with `model_name`), plus
quantship's start-up gauges. Canary against stable splits by `rollouts_pod_template_hash`, the pod
label Argo Rollouts puts on each revision (kept by a `labelmap __meta_kubernetes_pod_label_(.+)`
relabeling, as the AnalysisTemplate assumes). `$__rate_interval` is Grafana's own rate window.
"""

from __future__ import annotations

import json

from quantship.deploy.manifests import Plan, meta

SIDECAR_LABEL = "grafana_dashboard"
HASH = "rollouts_pod_template_hash"
RATE = "$__rate_interval"


def _quantiles(metric: str, model: str, by: str = "") -> list[tuple[str, str]]:
    group = f"le{', ' + by if by else ''}"
    return [(f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{model}}}[{RATE}])))",
             f"p{int(q * 100)}" + (f" {{{{{by}}}}}" if by else "")) for q in (0.5, 0.9, 0.99)]


def panel_specs(plan: Plan) -> list[dict]:
    """(title, unit, [(PromQL, legend)], description) of every panel, in order."""
    model = f'model_name="{plan.name}"'
    serving = f"vllm:num_requests_running{{{model}}}"
    api = 'handler=~"/v1/.*"'

    def errors(by: str = "") -> str:
        group = f" by ({by})" if by else ""
        bad = f'sum{group} (rate(http_requests_total{{{api},status=~"5.."}}[{RATE}]) and on (instance) {serving})'
        everything = f"sum{group} (rate(http_requests_total{{{api}}}[{RATE}]) and on (instance) {serving})"
        return f"({bad} or {everything} * 0) / {everything}"  # no 5xx series yet: a rate of 0

    p99_by_hash = (f"histogram_quantile(0.99, sum by (le, {HASH}) "
                   f"(rate(vllm:time_to_first_token_seconds_bucket{{{model}}}[{RATE}])))")
    return [
        {"title": "Time to first token", "unit": "s", "targets": _quantiles("vllm:time_to_first_token_seconds", model)},
        {"title": "Time per output token", "unit": "s",
         "targets": _quantiles("vllm:time_per_output_token_seconds", model)},
        {"title": "Inter-token latency", "unit": "s", "targets": _quantiles("vllm:inter_token_latency_seconds", model)},
        {"title": "End-to-end request latency", "unit": "s",
         "targets": _quantiles("vllm:e2e_request_latency_seconds", model)},
        {"title": "Requests waiting and running", "unit": "short",
         "targets": [(f"sum(vllm:num_requests_waiting{{{model}}})", "waiting"), (f"sum({serving})", "running")]},
        {"title": "Queue time", "unit": "s", "targets": _quantiles("vllm:request_queue_time_seconds", model)},
        {"title": "KV-cache usage", "unit": "percentunit",
         "targets": [(f"max by (instance) (vllm:kv_cache_usage_perc{{{model}}})", "{{instance}}")]},
        {"title": "Preemptions", "unit": "ops",
         "targets": [(f"sum(rate(vllm:num_preemptions_total{{{model}}}[{RATE}]))", "preemptions/s")]},
        {"title": "Tokens per second", "unit": "short",
         "targets": [(f"sum(rate(vllm:prompt_tokens_total{{{model}}}[{RATE}]))", "prompt"),
                     (f"sum(rate(vllm:generation_tokens_total{{{model}}}[{RATE}]))", "generated")]},
        {"title": "Requests by finish reason", "unit": "reqps",
         "targets": [(f"sum by (finished_reason) (rate(vllm:request_success_total{{{model}}}[{RATE}]))",
                      "{{finished_reason}}")]},
        {"title": "Error rate (5xx share of /v1 answers)", "unit": "percentunit", "targets": [(errors(), "5xx")]},
        {"title": "Canary vs stable: p99 time to first token", "unit": "s", "targets": [(p99_by_hash, f"{{{{{HASH}}}}}")],
         "description": "One line per pod template hash: during an Argo rollout, the canary and the stable revision."},
        {"title": "Canary vs stable: error rate", "unit": "percentunit", "targets": [(errors(HASH), f"{{{{{HASH}}}}}")],
         "description": "5xx share of /v1 answers per revision (rollouts_pod_template_hash)."},
        {"title": "Cold start by phase", "unit": "s",
         "targets": [(f"max by (phase) (quantship:startup_seconds{{{model}}})", "{{phase}}"),
                     (f"max(quantship:startup_to_first_token_seconds{{{model}}})", "to first token")],
         "description": "quantship serve's own start-up phases (they add up to the time to ready)."},
        {"title": "Weights load rate", "unit": "Bps",
         "targets": [(f'max(quantship:checkpoint_bytes{{{model}}} / ignoring (phase) '
                      f'quantship:startup_seconds{{{model},phase="load_weights"}})', "bytes/s")],
         "description": "Checkpoint bytes over the load_weights phase: what deploy's startupProbe is sized with."},
    ]


def queries(plan: Plan) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target."""
    return [(spec["title"], expr) for spec in panel_specs(plan) for expr, _ in spec["targets"]]


def dashboard_queries(config_map: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of a dashboard ConfigMap's every target, read back from its JSON."""
    found = []
    for text in (config_map.get("data") or {}).values():
        for panel in json.loads(text).get("panels", []):
            found += [(panel.get("title", ""), t["expr"]) for t in panel.get("targets", []) if t.get("expr")]
    return found


def as_rules(queries: list[tuple[str, str]], rate_interval: str = "5m") -> dict:
    """The queries as a Prometheus rules file (one recording rule each, Grafana's $__rate_interval
    replaced), so `promtool check rules` parses every one."""
    rules = [{"record": f"dashboard:panel_{i}", "expr": expr.replace(RATE, rate_interval)}
             for i, (_, expr) in enumerate(queries)]
    return {"groups": [{"name": "grafana-dashboard", "rules": rules}]}


def dashboard(plan: Plan) -> dict:
    panels = []
    for i, spec in enumerate(panel_specs(plan)):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": spec["title"], "description": spec.get("description", ""),
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": spec["unit"]}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
            "targets": [{"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend,
                         "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                        for j, (expr, legend) in enumerate(spec["targets"])],
        })
    return {
        "uid": f"quantship-{plan.name}"[:40], "title": f"quantship: {plan.name}", "tags": ["quantship", "llm-serving"],
        "timezone": "browser", "schemaVersion": 39, "version": 1, "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"}]},
        "panels": panels,
    }


def config_map(plan: Plan) -> dict:
    data = {f"quantship-{plan.name}.json": json.dumps(dashboard(plan), indent=2)}
    metadata = meta(plan, f"{plan.name}-grafana-dashboard")
    metadata["labels"][SIDECAR_LABEL] = "1"
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}
