"""`quantship deploy ONNX_EXPORT_DIR -o DIR`: manifests for a pod that serves an ONNX export.

Who serves it: `quantship serve` runs our own model code and cannot load an ONNX graph, and ONNX
Runtime GenAI is a library (no server; nor does it know MLA). What a cluster runs for ONNX is NVIDIA
Triton Inference Server with its onnxruntime backend: the graph is served as it is (KServe v2
HTTP/gRPC, /v2/models/NAME/infer), one decoder step per request, the client carrying the KV cache
tensors (past_key_values.* in, present.* out), as genai_config.json names them. There is no OpenAI
API and no continuous batching here: the graph's pasts differ in length per sequence, so the model
runs with max_batch_size 0 (batches are formed by the client, as ONNX Runtime's own loop does).

Triton wants a model repository (NAME/config.pbtxt, NAME/1/model.onnx); an init container builds it in
an emptyDir from the read-only model volume (links to model.onnx and its external data, plus the
config.pbtxt from the ConfigMap), so the export directory is mounted as quantship wrote it.
The config lists every input and output with its dtype and dynamic dims, read from the graph.

Not generated, and why: the autoscaler, canary overlay and Prometheus rules of `deploy` read vLLM's
metric names (vllm:num_requests_waiting, ...), which Triton does not export (its own are
nv_inference_*); the Deployment gets a fixed replica count instead (--replicas MIN).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from quantship import __version__
from quantship.deploy import manifests, sizing
from quantship.deploy.model import ModelFacts, count_parameters, directory_files, k8s_name
from quantship.errors import QuantshipError
from quantship.files import sha256_file

TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:24.08-py3"
TRITON_UID = 1000  # the image's triton-server user
TRITON_WARMUP_S = 60  # server start and ONNX Runtime session creation (graph optimization) after the read
HTTP, GRPC, METRICS = 8000, 8001, 8002
REPO = "/opt/model-repository"
EXPORT_FILES = ("model.onnx", "quantship_onnx.json", "genai_config.json", "SHA256SUMS", "config.json")
_TRITON_TYPES = {1: "TYPE_FP32", 10: "TYPE_FP16", 7: "TYPE_INT64", 6: "TYPE_INT32", 16: "TYPE_BF16", 9: "TYPE_BOOL"}


def is_onnx_export(path: Path) -> bool:
    return (path / "model.onnx").is_file()


def read_export(path: Path, name: str | None, size_gb: float | None) -> tuple[ModelFacts, dict]:
    """The facts of an ONNX export directory; a missing piece or a file changed since the export is refused."""
    from quantship.models.config import load_config

    missing = [f for f in EXPORT_FILES if not (path / f).is_file()]
    if missing:
        raise QuantshipError(f"not a complete quantship ONNX export (missing {', '.join(missing)})", path)
    info = json.loads((path / "quantship_onnx.json").read_text(encoding="utf-8"))
    for line in (path / "SHA256SUMS").read_text(encoding="utf-8").splitlines():
        digest, _, file = line.partition("  ")
        target = path / file
        if not target.is_file() or sha256_file(target) != digest:
            raise QuantshipError(f"{file} does not match the export's SHA256SUMS (changed or missing since the "
                                 "export)", path)
    config = load_config(path)
    if name is not None and k8s_name(name) != name:
        raise QuantshipError(f"--name {name!r} is not a DNS-1123 label of at most 40 characters "
                             f"(e.g. {k8s_name(name)!r})")
    files = directory_files(path)
    size = sum((path / f).stat().st_size for f in files)
    size_source = "files on disk"
    if size_gb is not None:
        if not 0 < size_gb < 1e9:
            raise QuantshipError(f"--size-gb must be a positive number of gigabytes, got {size_gb}")
        size, size_source = int(size_gb * 1e9), "--size-gb"
    layers, outside = count_parameters(config)
    facts = ModelFacts(name=name or k8s_name(path.resolve().name), source=str(path.resolve()),
                       architecture=config.architecture, parameters=layers + outside, size_bytes=size,
                       size_source=size_source, max_position_embeddings=config.max_position_embeddings,
                       num_attention_heads=config.num_attention_heads, quant_method="onnx",
                       quant_format=str(info.get("type", "fp32")), writer_version=_writer(info), files=files)
    return facts, info


def _writer(info: dict) -> str | None:
    writer = str(info.get("writer", ""))
    return writer.split(" ", 1)[1] if writer.startswith("quantship ") else None


def model_config_pbtxt(path: Path, name: str, gpu: bool) -> str:
    """Triton's config.pbtxt for the graph: every input and output with its type and dims (-1 = dynamic)."""
    import onnx

    graph = onnx.load(str(path / "model.onnx"), load_external_data=False).graph

    def entries(values) -> str:
        out = []
        for v in values:
            t = v.type.tensor_type
            if t.elem_type not in _TRITON_TYPES:
                raise QuantshipError(f"{v.name}: ONNX element type {t.elem_type} has no Triton data type", path)
            dims = ", ".join(str(d.dim_value) if d.HasField("dim_value") else "-1" for d in t.shape.dim)
            out.append(f'  {{ name: "{v.name}" data_type: {_TRITON_TYPES[t.elem_type]} dims: [ {dims} ] }}')
        return ",\n".join(out)

    return (f'# generated by quantship {__version__}: the ONNX export served by onnxruntime, one decoder step per '
            f'request\nname: "{name}"\nbackend: "onnxruntime"\nmax_batch_size: 0\n'
            f"input [\n{entries(graph.input)}\n]\noutput [\n{entries(graph.output)}\n]\n"
            f"instance_group [ {{ count: 1 kind: {'KIND_GPU' if gpu else 'KIND_CPU'} }} ]\n")


def check_options(opts) -> None:
    if opts.canary:
        raise QuantshipError("--canary is not available for an ONNX export: the canary analysis reads vLLM's "
                             "metrics (vllm:*), which Triton does not export")
    if opts.engine != "native":
        raise QuantshipError("--engine does not apply to an ONNX export: it is served by Triton's onnxruntime backend")


def build_objects(plan: manifests.Plan, pbtxt: str, replicas: int) -> dict[str, dict]:
    name = plan.name
    config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": manifests.meta(plan, f"{name}-triton"),
              "data": {"config.pbtxt": pbtxt}}
    s = plan.startup
    probe = lambda path, period, failures: {  # noqa: E731
        "httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "timeoutSeconds": 5,
        "failureThreshold": failures}
    small = {"cpu": "100m", "memory": "64Mi"}
    secure = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
    version_dir = f"{REPO}/{name}/1"
    link = (f"set -e; mkdir -p {version_dir}; cp /config/config.pbtxt {REPO}/{name}/config.pbtxt; "
            f"for f in {plan.model_path}/model.onnx*; do ln -s \"$f\" {version_dir}/; done")
    init = {"name": "model-repository", "image": plan.image, "imagePullPolicy": "IfNotPresent",
            "command": ["/bin/sh", "-c", link],
            "resources": {"requests": dict(small), "limits": dict(small)},
            "volumeMounts": [{"name": "model-cache", "mountPath": manifests.MODELS_MOUNT, "readOnly": True},
                             {"name": "triton-config", "mountPath": "/config", "readOnly": True},
                             {"name": "model-repository", "mountPath": REPO}],
            "securityContext": dict(secure)}
    server = {
        "name": "server", "image": plan.image, "imagePullPolicy": "IfNotPresent",
        "command": ["tritonserver"],
        "args": [f"--model-repository={REPO}", "--strict-readiness=true", "--exit-on-error=true",
                 f"--http-port={HTTP}", f"--grpc-port={GRPC}", f"--metrics-port={METRICS}"],
        "ports": [{"name": "http", "containerPort": HTTP, "protocol": "TCP"},
                  {"name": "grpc", "containerPort": GRPC, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": METRICS, "protocol": "TCP"}],
        "resources": {"requests": dict(plan.resources), "limits": dict(plan.resources)},
        "startupProbe": probe("/v2/health/live", s.period_s, s.failure_threshold),
        "livenessProbe": probe("/v2/health/live", 10, 3),
        "readinessProbe": probe("/v2/health/ready", 5, 3),
        "volumeMounts": [{"name": "model-cache", "mountPath": manifests.MODELS_MOUNT, "readOnly": True},
                         {"name": "model-repository", "mountPath": REPO, "readOnly": True},
                         {"name": "shm", "mountPath": "/dev/shm"}, {"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": dict(secure),
    }
    annotations = {manifests.ANNOTATION + "model-size-bytes": str(plan.model.size_bytes),
                   manifests.ANNOTATION + "load-bandwidth-bytes-per-second": str(int(plan.load_bytes_per_s)),
                   manifests.ANNOTATION + "warmup-seconds": str(TRITON_WARMUP_S),
                   manifests.ANNOTATION + "load-estimate-seconds": str(s.load_estimate_s),
                   manifests.ANNOTATION + "checkpoint-format": plan.model.checkpoint_format,
                   manifests.ANNOTATION + "version": __version__}
    config_hash = hashlib.sha256(pbtxt.encode()).hexdigest()[:16]
    pod = {
        "metadata": {"labels": dict(plan.labels),
                     "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS),
                                     "prometheus.io/path": "/metrics",
                                     manifests.ANNOTATION + "config-sha256": config_hash}},
        "spec": {
            "serviceAccountName": name, "automountServiceAccountToken": False, "terminationGracePeriodSeconds": 60,
            "securityContext": {"runAsNonRoot": True, "runAsUser": TRITON_UID, "runAsGroup": TRITON_UID,
                                "fsGroup": TRITON_UID, "seccompProfile": {"type": "RuntimeDefault"}},
            "initContainers": [init], "containers": [server],
            "volumes": [
                {"name": "model-cache",
                 "persistentVolumeClaim": {"claimName": f"{name}-model-cache", "readOnly": True}},
                {"name": "triton-config", "configMap": {"name": f"{name}-triton"}},
                {"name": "model-repository", "emptyDir": {"sizeLimit": "16Mi"}},
                {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
                {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
            ],
            **manifests._gpu_scheduling(plan),
        },
    }
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment",
                  "metadata": manifests.meta(plan, name, annotations=annotations),
                  "spec": {"replicas": replicas, "selector": {"matchLabels": dict(plan.selector)},
                           "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                           "progressDeadlineSeconds": s.budget_s + 600, "revisionHistoryLimit": 3, "template": pod}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": manifests.meta(plan, name),
               "spec": {"type": "ClusterIP", "selector": dict(plan.selector),
                        "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"},
                                  {"name": "grpc", "port": GRPC, "targetPort": "grpc", "protocol": "TCP"},
                                  {"name": "metrics", "port": METRICS, "targetPort": "metrics", "protocol": "TCP"}]}}
    return {"serviceaccount.yaml": manifests.service_account(plan), "configmap.yaml": config,
            "pvc.yaml": manifests.model_cache_pvc(plan), "deployment.yaml": deployment, "service.yaml": service,
            "pdb.yaml": manifests.disruption_budget(plan)}


def make_plan(facts: ModelFacts, opts) -> manifests.Plan:
    from quantship.deploy.generate import check_strings

    check_strings(opts)
    check_options(opts)
    gpus = opts.gpus if opts.gpus is not None else 0  # ONNX Runtime's CPU provider unless --gpus is given
    if gpus not in (0, 1):
        raise QuantshipError("--gpus for an ONNX export is 0 or 1: Triton's onnxruntime backend runs one model "
                             "instance per GPU, with no tensor parallelism")
    estimate = math.ceil(facts.size_bytes / (opts.load_mbps * 1e6) + TRITON_WARMUP_S)
    threshold = math.ceil(sizing.SAFETY * estimate / sizing.PERIOD_S)
    startup = sizing.Startup(load_estimate_s=estimate, budget_s=threshold * sizing.PERIOD_S,
                             failure_threshold=threshold)
    return manifests.Plan(
        model=facts, engine="triton-onnxruntime", gpus=gpus, gpu_type=opts.gpu_type,
        resources=sizing.pod_resources(facts.size_bytes, gpus, opts.cpu, opts.memory), startup=startup,
        load_bytes_per_s=opts.load_mbps * 1e6, replicas=sizing.parse_replicas(opts.replicas), autoscaler="none",
        canary=False, image=opts.image or TRITON_IMAGE, max_model_len=facts.max_position_embeddings,
        queue_target=opts.queue_target, prometheus_url=opts.prometheus_url, storage_class=opts.storage_class)


def build_files(plan: manifests.Plan, pbtxt: str, head: str) -> dict[str, str]:
    from quantship.deploy.checksums import MANIFEST_FILE
    from quantship.deploy.generate import dump

    objects = build_objects(plan, pbtxt, plan.replicas[0])
    files = {f"base/{name}": dump(obj, head) for name, obj in objects.items()}
    files["base/kustomization.yaml"] = dump({"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                                             "resources": list(objects)}, head)
    m = plan.model
    files[MANIFEST_FILE] = json.dumps({
        "quantship_version": __version__,
        "model": {"name": m.name, "source": m.source, "architecture": m.architecture, "parameters": m.parameters,
                  "size_bytes": m.size_bytes, "size_source": m.size_source,
                  "max_position_embeddings": m.max_position_embeddings},
        "checkpoint": {"format": m.checkpoint_format, "written_by": m.writer_version, "files": len(m.files),
                       "sums": "SHA256SUMS"},
        "plan": {"engine": plan.engine, "image": plan.image, "gpus": plan.gpus,
                 "gpu_type": plan.gpu_type if plan.gpus else None, "resources": plan.resources,
                 "replicas": [plan.replicas[0]] * 2, "autoscaler": None, "canary": False,
                 "protocol": "KServe v2 (Triton HTTP/gRPC), one decoder step per request",
                 "load_bandwidth_mb_per_s": plan.load_bytes_per_s / 1e6,
                 "startup": {"load_estimate_s": plan.startup.load_estimate_s, "budget_s": plan.startup.budget_s,
                             "failure_threshold": plan.startup.failure_threshold,
                             "period_s": plan.startup.period_s}},
    }, indent=2) + "\n"
    return files


def summary_lines(result: dict) -> list[str]:
    m, p = result["model"], result["plan"]
    r, s, out = p["resources"], p["startup"], result["out"]
    return [
        f"wrote {out} ({len(result['files'])} files) for {m['name']}: ONNX export ({result['checkpoint']['format']}) "
        f"of {m['architecture']}, {m['size_bytes'] / 1e6:.3g} MB",
        f"pod: Triton Inference Server ({p['image']}), onnxruntime backend on "
        f"{'1 x ' + p['gpu_type'] if p['gpus'] else 'CPU'}, cpu {r['cpu']}, memory {r['memory']} "
        "(requests = limits: Guaranteed QoS)",
        f"serves: KServe v2 on :80 (http) and :{GRPC} (grpc), /v2/models/{m['name']}/infer, one decoder step per "
        "request with the client's KV cache tensors (names in genai_config.json); metrics on :8002",
        f"startup: load estimate {s['load_estimate_s']}s -> startupProbe {s['failure_threshold']} x {s['period_s']}s",
        f"replicas: {p['replicas'][0]}, fixed: no autoscaler or canary (they read vLLM's metrics; Triton exports "
        "nv_inference_*)",
        f"validated offline; next: kubectl apply -k {out}/base",
    ]
