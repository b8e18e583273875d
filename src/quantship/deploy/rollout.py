"""The canary overlay: an Argo Rollouts `Rollout` that takes over the base Deployment, an
AnalysisTemplate built from the same rules as `quantship gate canary`, and the kustomization
that ties them to the base.

The Rollout references the Deployment (`workloadRef`) instead of copying its pod template, so
base and overlay cannot drift apart; `scaleDown: progressively` hands replicas over from the
Deployment as the Rollout's become ready, which matters when a replica takes many minutes to load.
"""

from __future__ import annotations

import yaml

from quantship.deploy.canary import Rules
from quantship.deploy.manifests import Plan, meta

# Argo labels each revision's pods with this hash; Prometheus keeps pod labels when its scrape
# config maps them (labelmap __meta_kubernetes_pod_label_(.+)), which is what tells canary from
# stable. The queries also expect the usual `namespace` target label of Kubernetes service discovery.
HASH_LABEL = "rollouts_pod_template_hash"
STEPS = (10, 50, 100)


def _selector(hash_arg: str) -> str:
    return f'namespace="{{{{args.namespace}}}}",{HASH_LABEL}="{{{{args.{hash_arg}}}}}"'


def analysis_template(plan: Plan, rules: Rules, failure_limit: int, interval: str) -> dict:
    """One Prometheus metric per rule, its query already the comparison:
    canary - (baseline * max_ratio + max_delta), which must stay <= 0. When either side has no
    requests the difference is NaN, which meets neither condition: Argo counts it inconclusive,
    as `gate canary` does."""
    metrics = []
    for rule in rules.rules:
        canary = rule.render(_selector("canary-hash"), rules.window)
        baseline = rule.render(_selector("stable-hash"), rules.window)
        limit = f"({baseline})" if rule.max_ratio == 1 else f"{rule.max_ratio:g} * ({baseline})"
        query = f"({canary}) - ({limit}{f' + {rule.max_delta:g}' if rule.max_delta else ''})"
        metrics.append({
            "name": rule.name.replace("_", "-"),
            "interval": interval,
            "failureLimit": failure_limit,
            "inconclusiveLimit": 2,
            "consecutiveErrorLimit": 4,
            "successCondition": "result[0] <= 0",
            "failureCondition": "result[0] > 0",
            "provider": {"prometheus": {"address": plan.prometheus_url, "query": query}},
        })
    return {"apiVersion": "argoproj.io/v1alpha1", "kind": "AnalysisTemplate",
            "metadata": meta(plan, f"{plan.name}-canary"),
            "spec": {"args": [{"name": "namespace"}, {"name": "canary-hash"}, {"name": "stable-hash"}],
                     "metrics": metrics}}


def rollout(plan: Plan, pause: str) -> dict:
    steps: list[dict] = []
    for weight in STEPS:
        steps.append({"setWeight": weight})
        if weight < 100:
            steps.append({"pause": {"duration": pause}})
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Rollout",
        "metadata": meta(plan, plan.name),
        "spec": {
            "selector": {"matchLabels": dict(plan.selector)},
            "workloadRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": plan.name,
                            "scaleDown": "progressively"},
            "revisionHistoryLimit": 3,
            # Argo's default deadline (10 min) is shorter than a large model's load.
            "progressDeadlineSeconds": plan.startup.budget_s + 600,
            "strategy": {"canary": {
                "maxSurge": 1,
                "maxUnavailable": 0,
                # Background analysis from the first pause on: it runs while traffic shifts and
                # aborts the rollout (back to stable) when a rule exceeds its failure limit.
                "analysis": {"templates": [{"templateName": f"{plan.name}-canary"}], "startingStep": 1,
                             "args": [{"name": "namespace",
                                       "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                                      {"name": "canary-hash", "valueFrom": {"podTemplateHashValue": "Latest"}},
                                      {"name": "stable-hash", "valueFrom": {"podTemplateHashValue": "Stable"}}]},
                "steps": steps,
            }},
        },
    }


def overlay_kustomization(plan: Plan) -> dict:
    """../base plus the Rollout; the autoscaler is pointed at the Rollout instead of the Deployment."""
    kind = "HorizontalPodAutoscaler" if plan.autoscaler == "hpa" else "ScaledObject"
    patch = [{"op": "replace", "path": "/spec/scaleTargetRef",
              "value": {"apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout", "name": plan.name}}]
    return {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": ["../base", "rollout.yaml", "analysistemplate.yaml"],
            "patches": [{"target": {"kind": kind, "name": plan.name},
                         "patch": yaml.safe_dump(patch, sort_keys=False)}]}
