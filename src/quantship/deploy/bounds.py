"""Numbers and requests that the OpenAPI schemas leave unbounded but the API server, the scheduler or
the autoscaler do not: negative replicas, an autoscaling range that is empty, a pod that runs CUDA
without a GPU, quantities that do not parse, probe settings the API refuses, drains that can never
evict. Each message names the object and the field, like every other check of `deploy validate`."""

from __future__ import annotations

from quantship.deploy.matching import parse_quantity

GPU = "nvidia.com/gpu"
PROBE_FIELDS = ("initialDelaySeconds", "periodSeconds", "timeoutSeconds", "successThreshold", "failureThreshold")


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_bounds(checker) -> None:
    for doc in checker.objects:
        spec = checker.spec(doc)
        if doc.kind in ("Deployment", "Rollout", "StatefulSet") and (_int(spec.get("replicas")) or 0) < 0:
            checker.fail(doc, "spec.replicas", f"{spec['replicas']} is negative")
        if doc.kind == "HorizontalPodAutoscaler":
            _range(checker, doc, spec.get("minReplicas", 1), spec.get("maxReplicas"), "spec.minReplicas",
                   "spec.maxReplicas", floor=1)
        if doc.kind == "ScaledObject":
            _range(checker, doc, spec.get("minReplicaCount", 0), spec.get("maxReplicaCount", 100),
                   "spec.minReplicaCount", "spec.maxReplicaCount", floor=0)
        if doc.kind == "PodDisruptionBudget":
            _disruption(checker, doc, spec)
    for doc, template in checker.templates():
        _pod(checker, doc, template.get("spec") or {})


def _range(checker, doc, low, high, low_path: str, high_path: str, floor: int) -> None:
    low, high = _int(low), _int(high)
    if low is not None and low < floor:
        why = " (0 needs the alpha HPAScaleToZero gate; a model that loads for minutes should not scale to zero)" \
            if floor == 1 else ""
        checker.fail(doc, low_path, f"{low} is below {floor}{why}")
    if high is not None and high < max(floor, 1):
        checker.fail(doc, high_path, f"{high} is below {max(floor, 1)}")
    if low is not None and high is not None and low > high:
        checker.fail(doc, low_path, f"{low} is above {high_path.rsplit('.', 1)[-1]} {high}: the range is empty")


def _disruption(checker, doc, spec: dict) -> None:
    if str(spec.get("maxUnavailable")) in ("0", "0%"):
        checker.fail(doc, "spec.maxUnavailable", "0 forbids every eviction: node drains would hang on these pods")
    if str(spec.get("minAvailable")) == "100%":
        checker.fail(doc, "spec.minAvailable", "100% forbids every eviction: node drains would hang on these pods")


def _runs_cuda(container: dict) -> bool:
    args = [str(a) for a in (container.get("command") or []) + (container.get("args") or [])]
    joined = [f"{a}={b}" if a == "--device" else a for a, b in zip(args, args[1:] + [""])]
    return any(a.startswith("--device=cuda") for a in joined)


def _asks_for_gpu(pod: dict) -> str | None:
    """Why this pod expects a GPU, if it does: CUDA in a container's arguments, or GPU-node scheduling."""
    for c in pod.get("containers") or []:
        if _runs_cuda(c):
            return f"container {c.get('name')} runs with --device cuda"
    if any(t.get("key") == GPU for t in pod.get("tolerations") or []):
        return f"it tolerates the {GPU} taint"
    if f"{GPU}.product" in str(pod.get("affinity")) + str(pod.get("nodeSelector")):
        return f"it is scheduled by {GPU}.product"
    return None


def _pod(checker, doc, pod: dict) -> None:
    gpus = 0
    for group in ("initContainers", "containers"):
        for i, c in enumerate(pod.get(group) or []):
            where = f"spec.template.spec.{group}[{i}]"
            resources = c.get("resources") or {}
            for kind in ("requests", "limits"):
                for name, value in (resources.get(kind) or {}).items():
                    amount = parse_quantity(value)
                    if amount is None or amount < 0:
                        checker.fail(doc, f"{where}.resources.{kind}.{name}", f"{value!r} is not a valid quantity")
                    elif name == GPU and amount != int(amount):
                        checker.fail(doc, f"{where}.resources.{kind}.{name}", f"{value} is not a whole number of GPUs")
            limit = parse_quantity((resources.get("limits") or {}).get(GPU, 0))
            gpus += int(limit) if limit and limit > 0 else 0
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                _probe(checker, doc, f"{where}.{probe}", probe, c.get(probe))
            for j, port in enumerate(c.get("ports") or []):
                if not 0 < (_int(port.get("containerPort")) or 0) < 65536:
                    checker.fail(doc, f"{where}.ports[{j}].containerPort", f"{port.get('containerPort')} is not a port")
    reason = _asks_for_gpu(pod)
    if reason and not gpus:
        checker.fail(doc, "spec.template.spec.containers", f"the pod expects a GPU ({reason}) but no container has "
                     f"resources.limits.{GPU}: it would be scheduled without one")


def _probe(checker, doc, where: str, kind: str, probe) -> None:
    if not isinstance(probe, dict):
        return
    for name in PROBE_FIELDS:
        value = _int(probe.get(name))
        if value is not None and value < 0:  # 0 means "the default" to the API server; below is refused
            checker.fail(doc, f"{where}.{name}", f"{value} is negative")
    if kind != "readinessProbe" and probe.get("successThreshold", 1) not in (0, 1):
        checker.fail(doc, f"{where}.successThreshold", f"must be 1 for a {kind} (the API server refuses others)")
