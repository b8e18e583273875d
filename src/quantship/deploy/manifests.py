"""The core Kubernetes objects of a served model, as plain dicts: ServiceAccount, ConfigMap, model
cache PVC, Deployment, Service, PodDisruptionBudget. autoscaling.py, rollout.py and monitoring.py add
the rest; generate.py writes them all.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass

from quantship import __version__
from quantship.deploy.model import ModelFacts
from quantship.deploy.serving import ServingPlan
from quantship.deploy.sizing import GIB, Startup

PORT = 8000
MODELS_MOUNT = "/models"
UID = 10001  # the non-root user of our image (Dockerfile); vLLM's image runs as any uid
VLLM_IMAGE = "vllm/vllm-openai:v0.11.0"
ANNOTATION = "quantship.io/"  # prefix of the facts validate reads back (size, bandwidth, warmup)


@dataclass
class Plan:
    """Everything decided about one deployment; the object builders only read it."""

    model: ModelFacts
    engine: str
    gpus: int
    gpu_type: str
    resources: dict[str, str]
    startup: Startup
    load_bytes_per_s: float
    replicas: tuple[int, int]
    autoscaler: str
    canary: bool
    image: str
    max_model_len: int
    queue_target: int
    prometheus_url: str
    storage_class: str | None = None
    ttft_slo_s: float = 2.0
    serving: ServingPlan | None = None  # batch and memory fraction from the capacity planner

    @property
    def name(self) -> str:
        return self.model.name

    @property
    def selector(self) -> dict[str, str]:
        return {"app.kubernetes.io/name": self.name, "app.kubernetes.io/component": "server"}

    @property
    def labels(self) -> dict[str, str]:
        return {**self.selector, "app.kubernetes.io/part-of": "quantship", "app.kubernetes.io/managed-by": "quantship",
                "app.kubernetes.io/version": __version__}

    @property
    def model_path(self) -> str:
        return f"{MODELS_MOUNT}/{self.name}"


def meta(plan: Plan, name: str, **extra) -> dict:
    return {"name": name, "labels": dict(plan.labels), **extra}


def service_account(plan: Plan) -> dict:
    # The server never talks to the API server: no token is mounted.
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(plan, plan.name),
            "automountServiceAccountToken": False}


def config_map(plan: Plan) -> dict:
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HOME": "/tmp", "HF_HOME": "/tmp/hf",
           "DO_NOT_TRACK": "1", "QUANTSHIP_MODEL": plan.model_path}
    if plan.engine == "vllm":
        env.update({"VLLM_NO_USAGE_STATS": "1", "VLLM_CACHE_ROOT": "/tmp/vllm"})
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta(plan, f"{plan.name}-config"), "data": env}


def model_cache_pvc(plan: Plan) -> dict:
    # ReadOnlyMany: every replica, on any node, mounts the same copy; it is filled once, out of band.
    size_gib = max(1, math.ceil(plan.model.size_bytes * 1.1 / GIB))
    spec = {"accessModes": ["ReadOnlyMany"], "volumeMode": "Filesystem",
            "resources": {"requests": {"storage": f"{size_gib}Gi"}}}
    if plan.storage_class:
        spec["storageClassName"] = plan.storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta(plan, f"{plan.name}-model-cache"),
            "spec": spec}


def server_args(plan: Plan) -> list[str]:
    """Arguments for the image's entrypoint: `quantship` in ours, `vllm serve` in vLLM's. A
    compressed-tensors or fp8 checkpoint needs no --quantization flag: vLLM reads it from config.json."""
    if plan.engine == "vllm":
        args = [plan.model_path, "--served-model-name", plan.name, "--host", "0.0.0.0", "--port", str(PORT),
                "--max-model-len", str(plan.max_model_len)]
        if plan.gpus > 1:
            args += ["--tensor-parallel-size", str(plan.gpus)]
        return args + _capacity_args(plan.serving, "--gpu-memory-utilization", "gpu_memory_utilization")
    return ["serve", plan.model_path, "--host", "0.0.0.0", "--port", str(PORT), "--served-model-name", plan.name,
            "--max-model-len", str(plan.max_model_len), "--device", "cuda" if plan.gpus else "cpu",
            *_capacity_args(plan.serving, "--kv-cache-fraction", "kv_cache_fraction")]


def _capacity_args(serving: ServingPlan | None, flag: str, field: str) -> list[str]:
    if serving is None or serving.max_num_seqs is None:
        return []
    args = ["--max-num-seqs", str(serving.max_num_seqs)]
    return args + ([flag, f"{getattr(serving, field):.2f}"] if getattr(serving, field) is not None else [])


def _probe(path: str, period: int, failures: int) -> dict:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "timeoutSeconds": 5,
            "failureThreshold": failures}


def container(plan: Plan) -> dict:
    s = plan.startup
    # vLLM has no /ready; it only listens once the model is loaded, so /health is its readiness.
    ready = "/ready" if plan.engine == "native" else "/health"
    return {
        "name": "server",
        "image": plan.image,
        "imagePullPolicy": "IfNotPresent",
        "args": server_args(plan),
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        "envFrom": [{"configMapRef": {"name": f"{plan.name}-config"}}],
        # Guaranteed QoS: requests == limits for every resource, so the kubelet evicts this pod last.
        "resources": {"requests": dict(plan.resources), "limits": dict(plan.resources)},
        "startupProbe": _probe("/health", s.period_s, s.failure_threshold),
        "livenessProbe": _probe("/health", 10, 3),
        "readinessProbe": _probe(ready, 5, 3),
        "volumeMounts": [{"name": "model-cache", "mountPath": MODELS_MOUNT, "readOnly": True},
                         {"name": "shm", "mountPath": "/dev/shm"}, {"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
    }


def _gpu_scheduling(plan: Plan) -> dict:
    if not plan.gpus:
        return {}
    term = {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": [plan.gpu_type]}]}
    return {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [term]}}},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}


def workload_annotations(plan: Plan) -> dict[str, str]:
    """The numbers behind the startup budget, so `deploy validate` can recheck it from the YAML alone."""
    return {ANNOTATION + "model-size-bytes": str(plan.model.size_bytes),
            ANNOTATION + "load-bandwidth-bytes-per-second": str(int(plan.load_bytes_per_s)),
            ANNOTATION + "warmup-seconds": f"{plan.startup.fixed_s:g}",
            **({ANNOTATION + "engine-load-bytes-per-second": str(int(plan.startup.load_rate_bytes_per_s))}
               if plan.startup.load_rate_bytes_per_s else {}),
            ANNOTATION + "load-estimate-seconds": str(plan.startup.load_estimate_s),
            ANNOTATION + "checkpoint-format": plan.model.checkpoint_format,
            ANNOTATION + "version": __version__, **capacity_annotations(plan.serving)}


def capacity_annotations(serving: ServingPlan | None) -> dict[str, str]:
    """Where the server's batch, memory fraction and GPU count came from."""
    if serving is None:
        return {}
    s = serving
    out = {ANNOTATION + "capacity-gpus": str(s.gpus), ANNOTATION + "capacity-note": s.note}
    if s.max_num_seqs is not None:
        out[ANNOTATION + "capacity-max-num-seqs"] = str(s.max_num_seqs)
        out[ANNOTATION + "capacity-sequences-held"] = ", ".join(f"{n} at {c} tokens" for c, n in s.seqs_at.items())
    for key, value in (("kv-cache-fraction", s.kv_cache_fraction), ("gpu-memory-utilization", s.gpu_memory_utilization)):
        if value is not None:
            out[ANNOTATION + f"capacity-{key}"] = f"{value:.2f}"
    if s.command:
        out[ANNOTATION + "capacity-plan"] = s.command
    return out


def pod_template(plan: Plan, config: dict) -> dict:
    config_hash = hashlib.sha256(json.dumps(config["data"], sort_keys=True).encode()).hexdigest()[:16]
    shm = "8Gi" if plan.gpus > 1 else "1Gi"  # NCCL between tensor-parallel ranks goes through /dev/shm
    return {
        "metadata": {
            "labels": dict(plan.labels),
            "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(PORT),
                            "prometheus.io/path": "/metrics",
                            # A changed ConfigMap changes the template, so pods restart with it.
                            ANNOTATION + "config-sha256": config_hash},
        },
        "spec": {
            "serviceAccountName": plan.name,
            "automountServiceAccountToken": False,
            # In-flight requests drain on SIGTERM; long generations need more than the default 30 s.
            "terminationGracePeriodSeconds": 120,
            "securityContext": {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [container(plan)],
            "volumes": [
                {"name": "model-cache", "persistentVolumeClaim": {"claimName": f"{plan.name}-model-cache",
                                                                  "readOnly": True}},
                {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}},
                {"name": "tmp", "emptyDir": {"sizeLimit": "4Gi"}},
            ],
            **_gpu_scheduling(plan),
        },
    }


def deployment(plan: Plan, config: dict) -> dict:
    # No `replicas`: the autoscaler owns it, and re-applying the YAML must not reset it.
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(plan, plan.name, annotations=workload_annotations(plan)),
        "spec": {
            "selector": {"matchLabels": dict(plan.selector)},
            # One extra pod at a time and none taken away before it is ready: GPUs are scarce and
            # a replica that leaves early costs a full cold start to replace.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "progressDeadlineSeconds": plan.startup.budget_s + 600,
            "revisionHistoryLimit": 3,
            "template": pod_template(plan, config),
        },
    }


def service(plan: Plan) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta(plan, plan.name),
            "spec": {"type": "ClusterIP", "selector": dict(plan.selector),
                     "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]}}


def disruption_budget(plan: Plan) -> dict:
    # maxUnavailable rather than minAvailable: with one replica, minAvailable 1 would block every node drain.
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": meta(plan, plan.name),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": dict(plan.selector)}}}
