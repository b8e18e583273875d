"""Autoscaling on the serving queue, `vllm:num_requests_waiting`, not on GPU utilisation.

A GPU serving a batch reads ~100% busy whether one request waits or a thousand, so utilisation
cannot tell a saturated replica from a comfortable one; the waiting queue can. Two ways to get
the metric to the HPA: prometheus-adapter (a rule exposes it as a custom Pods metric, an
autoscaling/v2 HPA targets its average) or a KEDA ScaledObject (KEDA queries Prometheus itself).
"""

from __future__ import annotations

import yaml

from quantship.deploy.manifests import Plan, meta

QUEUE_SERIES = "vllm:num_requests_waiting"
# prometheus-adapter serves custom metrics under URL paths, where ':' is awkward; its rule renames
# vllm:X to vllm_X and the HPA asks for that name.
ADAPTER_METRIC = "vllm_num_requests_waiting"
MAX_POLICY_PERIOD_S = 1800  # the API's limit on a scaling policy's periodSeconds


def behavior(cold_start_s: int) -> dict:
    """Scale-up sized to the cold start. New replicas only drain the queue once loaded, so for a whole
    cold start the queue stays long and the HPA would keep adding pods. Limiting additions to one
    doubling (or one pod) per cold start lets each wave arrive before the next is decided."""
    window = min(max(cold_start_s, 60), MAX_POLICY_PERIOD_S)
    return {
        "scaleUp": {"stabilizationWindowSeconds": min(60, cold_start_s), "selectPolicy": "Max",
                    "policies": [{"type": "Percent", "value": 100, "periodSeconds": window},
                                 {"type": "Pods", "value": 1, "periodSeconds": window}]},
        # A replica that took a cold start to load is given back only after the queue stayed short that long.
        "scaleDown": {"stabilizationWindowSeconds": min(max(300, cold_start_s), 3600), "selectPolicy": "Min",
                      "policies": [{"type": "Pods", "value": 1, "periodSeconds": 120}]},
    }


def _target(plan: Plan) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": plan.name}


def hpa(plan: Plan) -> dict:
    low, high = plan.replicas
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": meta(plan, plan.name),
        "spec": {
            "scaleTargetRef": _target(plan),
            "minReplicas": low,
            "maxReplicas": high,
            "metrics": [{"type": "Pods", "pods": {
                "metric": {"name": ADAPTER_METRIC},
                "target": {"type": "AverageValue", "averageValue": str(plan.queue_target)}}}],
            "behavior": behavior(plan.startup.load_estimate_s),
        },
    }


def adapter_rules(plan: Plan) -> dict:
    """The prometheus-adapter rule that serves ADAPTER_METRIC per pod. It belongs in the adapter's
    own configuration (its namespace, its ConfigMap), so it is written apart from the base."""
    rules = {"rules": [{
        "seriesQuery": f'{QUEUE_SERIES}{{namespace!="",pod!=""}}',
        "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
        "name": {"matches": "^vllm:(.*)$", "as": "vllm_${1}"},
        "metricsQuery": "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)",
    }]}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta(plan, "prometheus-adapter-rules"),
            "data": {"config.yaml": yaml.safe_dump(rules, sort_keys=False)}}


def scaled_object(plan: Plan) -> dict:
    low, high = plan.replicas
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": meta(plan, plan.name),
        "spec": {
            "scaleTargetRef": _target(plan),
            "pollingInterval": 15,
            # Never to zero: the first request after idling would wait a whole cold start.
            "minReplicaCount": low,
            "maxReplicaCount": high,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": behavior(plan.startup.load_estimate_s)}},
            "triggers": [{"type": "prometheus", "metricType": "AverageValue", "metadata": {
                "serverAddress": plan.prometheus_url,
                # The total queue of this model; KEDA's AverageValue divides it by the replica count.
                "query": f'sum({QUEUE_SERIES}{{model_name="{plan.name}"}})',
                "threshold": str(plan.queue_target)}}],
        },
    }
