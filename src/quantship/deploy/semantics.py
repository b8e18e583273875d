"""Checks across the objects of one build that no schema can express: selectors that select the
pods, Guaranteed QoS, a startup budget that covers the model's load, probes, GPU scheduling,
references between objects, and an autoscaler whose metric some prometheus-adapter rule serves
(bounds.py: numbers the API server refuses; object_meta.py: its rules for names, labels and ports).
"""

from __future__ import annotations

import math

from quantship.deploy.bounds import check_bounds
from quantship.deploy.kustomize import Doc
from quantship.deploy.manifests import ANNOTATION
from quantship.deploy.matching import adapter_metrics, parse_quantity, selects
from quantship.deploy.object_meta import check_object_meta
from quantship.deploy.sizing import load_estimate_s

STARTUP_KEYS = ("model-size-bytes", "load-bandwidth-bytes-per-second", "warmup-seconds")
MAX_POLICY_PERIOD_S = 1800


class Checker:
    def __init__(self, objects: list[Doc], context: list[Doc]):
        self.objects, self.context, self.problems = objects, context, []
        self.index = {(d.kind, d.name): d for d in objects}

    def fail(self, doc: Doc, path: str, message: str) -> None:
        self.problems.append(f"{doc.where()}: {doc.ident}: {path}: {message}")

    def spec(self, doc: Doc) -> dict:
        return doc.data.get("spec") or {}

    def template_owner(self, doc: Doc) -> Doc | None:
        """The object holding the pod template a workload runs (a Rollout may reference a Deployment)."""
        if doc.kind == "Rollout" and "workloadRef" in self.spec(doc):
            ref = self.spec(doc)["workloadRef"]
            return self.index.get((ref.get("kind"), ref.get("name")))
        return doc if doc.kind in ("Deployment", "Rollout") else None

    def templates(self) -> list[tuple[Doc, dict]]:
        return [(d, self.spec(d)["template"]) for d in self.objects
                if d.kind in ("Deployment", "Rollout") and isinstance(self.spec(d).get("template"), dict)]

    def estimate(self, doc: Doc | None) -> float | None:
        ann = ((doc.data.get("metadata") or {}).get("annotations") or {}) if doc else {}
        try:
            size, bandwidth, warmup = (float(ann[ANNOTATION + k]) for k in STARTUP_KEYS)
            rate = ann.get(ANNOTATION + "engine-load-bytes-per-second")
            return load_estimate_s(size, bandwidth, warmup, float(rate) if rate else None)
        except (KeyError, ValueError, ZeroDivisionError):
            return None

    def run(self) -> list[str]:
        for doc, template in self.templates():
            self.check_workload(doc, template)
        for doc in self.objects:
            check = {"Service": self.check_service, "PodDisruptionBudget": self.check_pdb,
                     "Rollout": self.check_rollout, "HorizontalPodAutoscaler": self.check_hpa,
                     "ScaledObject": self.check_scaled_object}.get(doc.kind)
            if check:
                check(doc)
        check_bounds(self)
        check_object_meta(self)
        return self.problems

    def check_workload(self, doc: Doc, template: dict) -> None:
        spec, labels = self.spec(doc), (template.get("metadata") or {}).get("labels")
        if not selects(spec.get("selector"), labels):
            self.fail(doc, "spec.selector", "does not select the pod template's labels (spec.template.metadata.labels)")
        estimate = self.estimate(doc)
        if estimate is None:
            self.fail(doc, "metadata.annotations", "needs " + ", ".join(ANNOTATION + k for k in STARTUP_KEYS)
                      + " to check the startup budget against the model's load time")
        pod = template.get("spec") or {}
        budgets = []
        for group in ("initContainers", "containers"):
            for i, c in enumerate(pod.get(group) or []):
                where = f"spec.template.spec.{group}[{i}]"
                self.check_qos(doc, where, c.get("resources") or {})
                if group == "containers":
                    budgets.append(self.check_probes(doc, where, c, estimate))
                for j, mount in enumerate(c.get("volumeMounts") or []):
                    if mount.get("name") not in {v.get("name") for v in pod.get("volumes") or []}:
                        self.fail(doc, f"{where}.volumeMounts[{j}].name", f"no volume named {mount.get('name')!r}")
                for j, source in enumerate(c.get("envFrom") or []):
                    ref = (source.get("configMapRef") or {}).get("name")
                    if ref and ("ConfigMap", ref) not in self.index:
                        self.fail(doc, f"{where}.envFrom[{j}].configMapRef.name", f"no ConfigMap {ref} in this build")
        self.check_pod_refs(doc, pod)
        deadline = spec.get("progressDeadlineSeconds", 600)
        if budgets and max(budgets) > deadline:
            self.fail(doc, "spec.progressDeadlineSeconds", f"{deadline}s is shorter than the startup budget "
                      f"({max(budgets)}s): the rollout would be marked failed while pods still load")

    def check_qos(self, doc: Doc, where: str, resources: dict) -> None:
        """Guaranteed QoS: limits for cpu and memory, and requests (defaulted from limits) equal to them."""
        requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
        for name in ("cpu", "memory"):
            if name not in limits:
                self.fail(doc, f"{where}.resources.limits.{name}",
                          "missing: Guaranteed QoS needs cpu and memory limits")
        for name, value in requests.items():
            if name not in limits:
                self.fail(doc, f"{where}.resources.limits.{name}", f"missing while requests.{name} is {value}")
            elif parse_quantity(value) is None or parse_quantity(value) != parse_quantity(limits[name]):
                self.fail(doc, f"{where}.resources.requests.{name}", f"{value} differs from limits.{name} "
                          f"{limits[name]}: Guaranteed QoS needs requests equal to limits")

    def check_probes(self, doc: Doc, where: str, c: dict, estimate: float | None) -> int:
        for probe in ("livenessProbe", "readinessProbe"):
            if probe not in c:
                self.fail(doc, f"{where}.{probe}", "missing")
        probe = c.get("startupProbe")
        if probe is None:
            self.fail(doc, f"{where}.startupProbe", "missing: without it the liveness probe kills a pod still loading")
            return 0
        budget = probe.get("initialDelaySeconds", 0) + probe.get("failureThreshold", 3) * probe.get("periodSeconds", 10)
        if estimate is not None and budget < estimate:
            self.fail(doc, f"{where}.startupProbe.failureThreshold", f"startup budget {budget}s "
                      f"(initialDelaySeconds + failureThreshold × periodSeconds) is below the load estimate "
                      f"{math.ceil(estimate)}s (model size / load bandwidth + size / engine load rate + warm-up, from the "
                      "annotations)")
        return budget

    def check_pod_refs(self, doc: Doc, pod: dict) -> None:
        account = pod.get("serviceAccountName")
        if account and account != "default" and ("ServiceAccount", account) not in self.index:
            self.fail(doc, "spec.template.spec.serviceAccountName", f"no ServiceAccount {account} in this build")
        for i, volume in enumerate(pod.get("volumes") or []):
            claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
            if claim and ("PersistentVolumeClaim", claim) not in self.index:
                self.fail(doc, f"spec.template.spec.volumes[{i}].persistentVolumeClaim.claimName",
                          f"no PersistentVolumeClaim {claim} in this build")
        gpus = any("nvidia.com/gpu" in ((c.get("resources") or {}).get("limits") or {})
                   for c in pod.get("containers") or [])
        if gpus:
            if not any(t.get("key") == "nvidia.com/gpu" or (t.get("operator") == "Exists" and not t.get("key"))
                       for t in pod.get("tolerations") or []):
                self.fail(doc, "spec.template.spec.tolerations",
                          "GPU pods need a toleration for the nvidia.com/gpu taint")
            if "nvidia.com/gpu.product" not in str(pod.get("affinity")) + str(pod.get("nodeSelector")):
                self.fail(doc, "spec.template.spec.affinity", "GPU pods need node affinity on nvidia.com/gpu.product")

    def _selects_pods(self, doc: Doc, selector) -> list[tuple[Doc, dict]]:
        chosen = [(d, t) for d, t in self.templates() if selects(selector, (t.get("metadata") or {}).get("labels"))]
        if not chosen:
            self.fail(doc, "spec.selector", "selects no pods of any Deployment or Rollout in this build")
        return chosen

    def check_service(self, doc: Doc) -> None:
        chosen = self._selects_pods(doc, self.spec(doc).get("selector"))
        ports = {p.get("name") for _, t in chosen for c in (t.get("spec") or {}).get("containers", [])
                 for p in c.get("ports") or []}
        for i, port in enumerate(self.spec(doc).get("ports") or []):
            target = port.get("targetPort")
            if chosen and isinstance(target, str) and target not in ports:
                self.fail(doc, f"spec.ports[{i}].targetPort",
                          f"no container port named {target!r} in the selected pods")

    def check_pdb(self, doc: Doc) -> None:
        self._selects_pods(doc, self.spec(doc).get("selector"))

    def check_rollout(self, doc: Doc) -> None:
        spec = self.spec(doc)
        if "workloadRef" in spec:
            owner = self.template_owner(doc)
            if owner is None:
                self.fail(doc, "spec.workloadRef.name", f"no {spec['workloadRef'].get('kind')} "
                          f"{spec['workloadRef'].get('name')} in this build")
            else:
                labels = ((self.spec(owner).get("template") or {}).get("metadata") or {}).get("labels")
                if not selects(spec.get("selector"), labels):
                    self.fail(doc, "spec.selector", f"does not select the pod labels of {owner.ident}")
        canary = (spec.get("strategy") or {}).get("canary") or {}
        steps = canary.get("steps") or []
        analyses = [("spec.strategy.canary.analysis", canary.get("analysis"))] + [
            (f"spec.strategy.canary.steps[{i}].analysis", step.get("analysis")) for i, step in enumerate(steps)]
        for where, analysis in analyses:
            if not analysis:
                continue
            given = {a.get("name") for a in analysis.get("args") or []}
            for i, ref in enumerate(analysis.get("templates") or []):
                template = self.index.get(("AnalysisTemplate", ref.get("templateName")))
                if template is None:
                    self.fail(doc, f"{where}.templates[{i}].templateName",
                              f"no AnalysisTemplate {ref.get('templateName')} in this build")
                    continue
                for arg in self.spec(template).get("args") or []:
                    if "value" not in arg and "valueFrom" not in arg and arg.get("name") not in given:
                        self.fail(doc, f"{where}.args", f"missing arg {arg.get('name')!r} that {template.ident} needs")

    def _target(self, doc: Doc, ref: dict, where: str) -> Doc | None:
        target = self.index.get((ref.get("kind", "Deployment"), ref.get("name")))
        if target is None:
            self.fail(doc, f"{where}.name", f"no {ref.get('kind', 'Deployment')} {ref.get('name')} in this build")
        return target

    def check_behavior(self, doc: Doc, target: Doc | None, behavior: dict | None, where: str) -> None:
        """Scale-up must be rate-limited over at least a cold start (capped at the API's 1800 s)."""
        cold = self.estimate(self.template_owner(target)) if target else None
        if cold is None:
            return
        need = min(int(cold), MAX_POLICY_PERIOD_S)
        policies = ((behavior or {}).get("scaleUp") or {}).get("policies") or []
        if not policies:
            self.fail(doc, f"{where}.scaleUp.policies", f"missing: scale-up should be limited per cold start ({need}s)")
        for i, p in enumerate(policies):
            if p.get("periodSeconds", 0) < need:
                self.fail(doc, f"{where}.scaleUp.policies[{i}].periodSeconds", f"{p.get('periodSeconds')}s is shorter "
                          f"than the cold start ({need}s): replicas would be added again before the last ones load")

    def check_hpa(self, doc: Doc) -> None:
        spec = self.spec(doc)
        target = self._target(doc, spec.get("scaleTargetRef") or {}, "spec.scaleTargetRef")
        served = adapter_metrics(self.context)
        for i, metric in enumerate(spec.get("metrics") or []):
            kind = {"Pods": "pods", "Object": "object", "External": "external"}.get(metric.get("type"))
            name = ((metric.get(kind) or {}).get("metric") or {}).get("name") if kind else None
            if name and name not in served:
                known = ", ".join(sorted(served)) or "none found"
                self.fail(doc, f"spec.metrics[{i}].{kind}.metric.name", f"no prometheus-adapter rule serves {name!r} "
                          f"(rules in this directory serve: {known})")
        self.check_behavior(doc, target, spec.get("behavior"), "spec.behavior")

    def check_scaled_object(self, doc: Doc) -> None:
        spec = self.spec(doc)
        target = self._target(doc, spec.get("scaleTargetRef") or {}, "spec.scaleTargetRef")
        behavior = ((spec.get("advanced") or {}).get("horizontalPodAutoscalerConfig") or {}).get("behavior")
        self.check_behavior(doc, target, behavior, "spec.advanced.horizontalPodAutoscalerConfig.behavior")


def check_build(objects: list[Doc], context: list[Doc]) -> list[str]:
    return Checker(objects, context).run()
