"""Prometheus recording and alert rules for one served model (a plain rules file: load it with
`rule_files`, or wrap it in a PrometheusRule for the operator). `promtool check rules` accepts it
and the tests run `promtool test rules` on the alerts.

Series are picked by `model_name`, the label vLLM (and quantship serve) put on every vllm:* metric.
The HTTP counter (`http_requests_total`, as vLLM exports it) has no model_name, so the error ratio
keeps only the scrape targets (`instance`) that also report this model's vllm:* metrics.
"""

from __future__ import annotations

import math

from quantship.deploy.manifests import Plan

ERROR_RATIO_ALERT = 0.01


def _minutes(seconds: float) -> str:
    return f"{max(1, math.ceil(seconds / 60))}m"


def rules_file(plan: Plan) -> dict:
    name = plan.name
    model = f'model_name="{name}"'
    serving = f"vllm:num_requests_running{{{model}}}"
    api = 'handler=~"/v1/.*"'

    def p99(histogram: str) -> str:
        return f"histogram_quantile(0.99, sum by (le) (rate({histogram}_bucket{{{model}}}[5m])))"

    errors = f'sum(rate(http_requests_total{{{api},status=~"5.."}}[5m]) and on (instance) {serving})'
    requests = f"sum(rate(http_requests_total{{{api}}}[5m]) and on (instance) {serving})"
    labels = {"model_name": name}
    recording = [
        {"record": "quantship:ttft_seconds:p99_5m", "expr": p99("vllm:time_to_first_token_seconds"), "labels": labels},
        {"record": "quantship:e2e_latency_seconds:p99_5m", "expr": p99("vllm:e2e_request_latency_seconds"),
         "labels": labels},
        {"record": "quantship:num_requests_waiting:avg", "expr": f"avg(vllm:num_requests_waiting{{{model}}})",
         "labels": labels},
        # No 5xx series yet means no errors: a ratio of 0 while requests flow.
        {"record": "quantship:error_ratio:rate5m", "expr": f"({errors} or vector(0)) / {requests}", "labels": labels},
    ]
    cold_start = plan.startup.load_estimate_s
    alerts = [
        {"alert": "QuantshipTTFTHigh",
         "expr": f"quantship:ttft_seconds:p99_5m{{{model}}} > {plan.ttft_slo_s:g}", "for": "10m",
         "labels": {"severity": "warning"},
         "annotations": {"summary": f"{name}: p99 time to first token above {plan.ttft_slo_s:g}s for 10 minutes",
                         "description": "p99 TTFT is {{ $value | humanizeDuration }}."}},
        {"alert": "QuantshipErrorRatioHigh",
         "expr": f"quantship:error_ratio:rate5m{{{model}}} > {ERROR_RATIO_ALERT:g}", "for": "5m",
         "labels": {"severity": "critical"},
         "annotations": {"summary": f"{name}: more than {ERROR_RATIO_ALERT:.0%} of API requests fail (5xx)",
                         "description": "error ratio is {{ $value | humanizePercentage }}."}},
        # The autoscaler targets queue_target waiting requests per replica; twice that for longer
        # than a cold start means it cannot catch up (at maxReplicas, or no GPU node free).
        {"alert": "QuantshipQueueBacklog",
         "expr": f"quantship:num_requests_waiting:avg{{{model}}} > {2 * plan.queue_target}",
         "for": _minutes(max(900, cold_start + 300)),
         "labels": {"severity": "warning"},
         "annotations": {"summary": f"{name}: requests keep waiting although the autoscaler had time to add replicas",
                         "description": "{{ $value }} requests waiting per replica."}},
        # A first start is allowed its whole startup budget before silence is an alert.
        {"alert": "QuantshipMetricsAbsent", "expr": f"absent({serving})",
         "for": _minutes(plan.startup.budget_s + 300),
         "labels": {"severity": "critical"},
         "annotations": {"summary": f"{name}: no replica reports serving metrics"}},
    ]
    return {"groups": [{"name": f"quantship-{name}.recording", "interval": "30s", "rules": recording},
                       {"name": f"quantship-{name}.alerts", "rules": alerts}]}
