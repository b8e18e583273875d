"""`quantship deploy MODEL -o DIR`: decide the plan, build every object, write the directory.

    DIR/base/            kustomization + ServiceAccount, ConfigMap, PVC, Deployment, Service, PDB,
                         and the HPA or KEDA ScaledObject          (kubectl apply -k DIR/base)
    DIR/canary/          with --canary: Rollout + AnalysisTemplate over ../base (kubectl apply -k DIR/canary)
    DIR/monitoring/      Prometheus recording/alert rules; the prometheus-adapter rule (HPA only); a Grafana
                         dashboard ConfigMap for the Grafana sidecar
    DIR/Dockerfile       the server image for --engine native
    DIR/SHA256SUMS       every weight and config file of the model
    DIR/quantship-manifest.json   quantship's version, the checkpoint's format and writer, the plan

Everything is written to a temporary sibling directory, validated there, then renamed into place,
so a failure never leaves a half-written DIR.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from quantship import __version__
from quantship.deploy import autoscaling, dashboard, manifests, monitoring, rollout, sizing
from quantship.deploy.canary import load_rules
from quantship.deploy.checksums import MANIFEST_FILE, SUMS_FILE, sums_text
from quantship.deploy.matching import parse_quantity
from quantship.deploy.model import ModelFacts, read_model
from quantship.deploy.object_meta import LABEL_VALUE, is_subdomain
from quantship.deploy.serving import serving_plan
from quantship.errors import QuantshipError
from quantship.files import check_output_location, publish_directory
from quantship.models.bundled import resolve_model


@dataclass
class DeployOptions:
    engine: str = "native"
    gpu_type: str = sizing.DEFAULT_GPU
    gpus: int | None = None  # None: as many as the weights need; 0: CPU only
    replicas: str = "1:4"
    canary: bool = False
    autoscaler: str = "hpa"
    image: str | None = None
    max_model_len: int | None = None
    load_mbps: float = sizing.DEFAULT_LOAD_MBPS
    engine_load_mbps: float | None = None  # default: the measured rate of deploy/startup.yaml
    storage_class: str | None = None
    prometheus_url: str = "http://prometheus-operated.monitoring.svc:9090"
    queue_target: int = 5
    cpu: str | None = None
    memory: str | None = None
    size_gb: float | None = None
    name: str | None = None
    canary_pause: str = "10m"
    analysis_interval: str = "1m"
    failure_limit: int = 1
    rules: str | None = None
    ttft_slo_s: float = 2.0
    overwrite: bool = False


DOCKERFILE = """\
# quantship server image ({version}). Build from the quantship source tree:
#   docker build -f {out}/Dockerfile -t quantship-server:{version} .
# The model is never baked in: it is mounted read-only at /models (the model-cache PVC).
# Pinned base: an exact Python and Debian release, so rebuilds get the same interpreter.
FROM python:3.12.8-slim-bookworm
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \\
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HOME=/tmp
RUN groupadd --gid {uid} quantship && \\
    useradd --uid {uid} --gid {uid} --no-create-home --shell /usr/sbin/nologin quantship
WORKDIR /opt/quantship
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install --no-cache-dir . && rm -rf /root/.cache
USER {uid}:{uid}
EXPOSE {port}
ENTRYPOINT ["quantship"]
CMD ["serve", "/models/model", "--host", "0.0.0.0", "--port", "{port}"]
"""


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data) -> bool:  # a shared dict is written out twice, never as &anchor/*alias
        return True


def _str(dumper, data: str):
    # Block style for multi-line strings (patches, adapter config) so the YAML stays readable.
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|" if "\n" in data else None)


_Dumper.add_representer(str, _str)


def dump(objects: list[dict] | dict, header: str = "") -> str:
    docs = objects if isinstance(objects, list) else [objects]
    body = "---\n".join(yaml.dump(d, Dumper=_Dumper, sort_keys=False, width=120) for d in docs)
    return (f"# {header}\n" if header else "") + body


def check_strings(opts: DeployOptions) -> None:
    """Values copied into the manifests verbatim: refused here in one line, instead of failing our own
    validation afterwards or, worse, the API server's."""
    for flag, value in (("--cpu", opts.cpu), ("--memory", opts.memory)):
        if value is not None and not (parse_quantity(value) or 0) > 0:
            raise QuantshipError(f"{flag} {value!r} is not a positive Kubernetes quantity (e.g. 8, 500m, 64Gi)")
    if not LABEL_VALUE.fullmatch(opts.gpu_type):
        raise QuantshipError(f"--gpu-type {opts.gpu_type!r} is not a valid label value (63 characters at most: "
                             "letters, digits, '-', '_', '.'), as nvidia.com/gpu.product needs")
    if opts.storage_class is not None and not is_subdomain(opts.storage_class):
        raise QuantshipError(f"--storage-class {opts.storage_class!r} is not a DNS-1123 subdomain (lowercase "
                             "letters, digits, '-', '.')")
    if opts.image is not None and (not opts.image or any(c.isspace() for c in opts.image)):
        raise QuantshipError(f"--image {opts.image!r} is not an image reference")
    url = urlsplit(opts.prometheus_url)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise QuantshipError(f"--prometheus-url {opts.prometheus_url!r} is not an http(s) URL")


def make_plan(facts: ModelFacts, opts: DeployOptions, model: str | Path = "tiny") -> manifests.Plan:
    check_strings(opts)
    if opts.engine not in sizing.ENGINES:
        raise QuantshipError(f"--engine must be one of {', '.join(sizing.ENGINES)}")
    if opts.autoscaler not in ("hpa", "keda"):
        raise QuantshipError("--autoscaler must be hpa or keda")
    if opts.queue_target < 1 or not 0 < opts.ttft_slo_s < math.inf:
        raise QuantshipError("--queue-target must be at least 1 and --ttft-slo positive")
    if opts.gpus is not None and (opts.gpus < 0 or (opts.gpus == 0 and opts.engine == "vllm")):
        raise QuantshipError("--gpus must be >= 0 (0, CPU only, needs --engine native)")
    if opts.max_model_len is not None and not 0 < opts.max_model_len <= facts.max_position_embeddings:
        raise QuantshipError(f"--max-model-len must be in 1..{facts.max_position_embeddings} for this model")
    max_model_len = opts.max_model_len or min(facts.max_position_embeddings, 32768)
    serving = serving_plan(facts.source, opts.gpu_type, opts.gpus, opts.engine, max_model_len, facts.num_attention_heads)
    gpus = serving.gpus
    image = opts.image or (manifests.VLLM_IMAGE if opts.engine == "vllm" else f"quantship-server:{__version__}")
    return manifests.Plan(
        model=facts, engine=opts.engine, gpus=gpus, gpu_type=opts.gpu_type,
        resources=sizing.pod_resources(facts.size_bytes, gpus, opts.cpu, opts.memory),
        startup=sizing.startup(facts.size_bytes, opts.load_mbps, opts.engine, "cuda" if gpus else "cpu",
                               opts.engine_load_mbps),
        load_bytes_per_s=opts.load_mbps * 1e6, replicas=sizing.parse_replicas(opts.replicas),
        autoscaler=opts.autoscaler, canary=opts.canary, image=image,
        max_model_len=max_model_len, queue_target=opts.queue_target, prometheus_url=opts.prometheus_url,
        storage_class=opts.storage_class, ttft_slo_s=opts.ttft_slo_s, serving=serving)


def build(plan: manifests.Plan, opts: DeployOptions, out: str = "DIR") -> dict[str, str]:
    """{relative path: text} for every generated file but SHA256SUMS."""
    head = f"generated by quantship {__version__} for {plan.model.source}"
    config = manifests.config_map(plan)
    scaler = ("hpa.yaml", autoscaling.hpa(plan)) if plan.autoscaler == "hpa" else \
        ("scaledobject.yaml", autoscaling.scaled_object(plan))
    base = {"serviceaccount.yaml": manifests.service_account(plan), "configmap.yaml": config,
            "pvc.yaml": manifests.model_cache_pvc(plan), "deployment.yaml": manifests.deployment(plan, config),
            "service.yaml": manifests.service(plan), "pdb.yaml": manifests.disruption_budget(plan),
            scaler[0]: scaler[1]}
    files = {f"base/{name}": dump(obj, head) for name, obj in base.items()}
    files["base/kustomization.yaml"] = dump({"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                                             "resources": list(base)}, head)
    if plan.canary:
        rules = load_rules(opts.rules)
        files["canary/kustomization.yaml"] = dump(rollout.overlay_kustomization(plan), head)
        files["canary/rollout.yaml"] = dump(rollout.rollout(plan, opts.canary_pause), head)
        files["canary/analysistemplate.yaml"] = dump(
            rollout.analysis_template(plan, rules, opts.failure_limit, opts.analysis_interval), head)
    files["monitoring/prometheus-rules.yaml"] = dump(monitoring.rules_file(plan), head)
    files["monitoring/grafana-dashboard.yaml"] = dump(
        dashboard.config_map(plan), head + "; apply it where Grafana's dashboard sidecar looks (label grafana_dashboard)")
    if plan.autoscaler == "hpa":
        files["monitoring/prometheus-adapter-rules.yaml"] = dump(
            autoscaling.adapter_rules(plan), head + "; merge its rule into your prometheus-adapter configuration")
    files["Dockerfile"] = DOCKERFILE.format(version=__version__, uid=manifests.UID, port=manifests.PORT,
                                            out=out)
    files[MANIFEST_FILE] = json.dumps(manifest(plan), indent=2) + "\n"
    return files


def manifest(plan: manifests.Plan) -> dict:
    m = plan.model
    return {
        "quantship_version": __version__,
        "model": {"name": m.name, "source": m.source, "architecture": m.architecture, "parameters": m.parameters,
                  "size_bytes": m.size_bytes, "size_source": m.size_source,
                  "max_position_embeddings": m.max_position_embeddings},
        "checkpoint": {"format": m.checkpoint_format, "written_by": m.writer_version, "files": len(m.files),
                       "sums": SUMS_FILE},
        "plan": {"engine": plan.engine, "image": plan.image, "gpus": plan.gpus,
                 "gpu_type": plan.gpu_type if plan.gpus else None, "resources": plan.resources,
                 "replicas": list(plan.replicas), "autoscaler": plan.autoscaler, "canary": plan.canary,
                 "max_model_len": plan.max_model_len, "queue_target": plan.queue_target,
                 "load_bandwidth_mb_per_s": plan.load_bytes_per_s / 1e6, "startup": asdict(plan.startup),
                 "capacity": plan.serving.to_dict() if plan.serving else None},
    }


def generate(model: str | Path, out: str | Path, opts: DeployOptions) -> dict:
    from quantship.deploy.validate import validate_dir

    out = Path(out)
    if out.exists() and not opts.overwrite:
        raise QuantshipError("output directory exists (pass --overwrite to replace it)", out)
    check_output_location(out, "output directory")
    from quantship.deploy import onnx_server

    source = resolve_model(model)
    if onnx_server.is_onnx_export(source):  # served by Triton's onnxruntime backend, not by quantship
        facts, _ = onnx_server.read_export(source, opts.name, opts.size_gb)
        plan = onnx_server.make_plan(facts, opts)
        pbtxt = onnx_server.model_config_pbtxt(source, plan.name, bool(plan.gpus))
        files = onnx_server.build_files(plan, pbtxt, f"generated by quantship {__version__} for {facts.source}")
        summary = json.loads(files[MANIFEST_FILE])
    else:
        facts = read_model(model, name=opts.name, size_gb=opts.size_gb)
        plan = make_plan(facts, opts, model)
        files = build(plan, opts, str(out))
        summary = manifest(plan)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for rel, text in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_text(text, encoding="utf-8")
        (tmp / SUMS_FILE).write_text(sums_text(resolve_model(model), facts.files), encoding="utf-8")
        problems = validate_dir(tmp).problems
        if problems:  # our own output failing our own checks is a bug: say so, write nothing
            raise RuntimeError("generated manifests failed validation:\n" + "\n".join(problems))
        publish_directory(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out": str(out), "files": sorted([*files, SUMS_FILE]), **summary}


def _human(n: float, unit: str) -> str:
    """38.7 MB, 349 GB; counts as 671B parameters."""
    prefixes = ("B", "M", "K") if unit == "parameters" else ("G", "M", "K")
    for prefix, scale in zip(prefixes, (1e9, 1e6, 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{prefix} {unit}" if unit == "parameters" else f"{n / scale:.3g} {prefix}{unit}"
    return f"{n:g} {unit}"


def summary_lines(result: dict) -> list[str]:
    if result["checkpoint"]["format"].startswith("onnx/"):
        from quantship.deploy.onnx_server import summary_lines as onnx_lines

        return onnx_lines(result)
    m, p, s = result["model"], result["plan"], result["plan"]["startup"]
    gpus = f"{p['gpus']} x {p['gpu_type']}" if p["gpus"] else "no GPU"
    r = p["resources"]
    out = result["out"]
    rate = f" + at {s['load_rate_bytes_per_s'] / 1e6:.0f} MB/s loaded" if s.get("load_rate_bytes_per_s") else ""
    lines = [
        f"wrote {out} ({len(result['files'])} files) for {m['name']}: {m['architecture']}, "
        f"{_human(m['parameters'], 'parameters')}, {_human(m['size_bytes'], 'B')} ({m['size_source']}), "
        f"{result['checkpoint']['format']}",
        f"pod: {gpus}, cpu {r['cpu']}, memory {r['memory']} (requests = limits: Guaranteed QoS); "
        f"engine {p['engine']}, image {p['image']}",
        f"startup: load estimate {s['load_estimate_s']}s ({_human(m['size_bytes'], 'B')} at "
        f"{p['load_bandwidth_mb_per_s']:g} MB/s read{rate} + {s['fixed_s']:g}s start-up) -> startupProbe "
        f"{s['failure_threshold']} x {s['period_s']}s = {s['budget_s']}s",
        f"autoscaling: {p['autoscaler']} on vllm:num_requests_waiting (target {p['queue_target']} per replica), "
        f"replicas {p['replicas'][0]}..{p['replicas'][1]}, scale-up at most doubling per cold start",
    ]
    c = p.get("capacity")
    if c and c["max_num_seqs"] is not None:
        memory = (f", --kv-cache-fraction {c['kv_cache_fraction']:.2f}" if c["kv_cache_fraction"] is not None else
                  f", --gpu-memory-utilization {c['gpu_memory_utilization']:.2f}" if c["gpu_memory_utilization"] else "")
        held = ", ".join(f"{n} at {ctx}" for ctx, n in c["seqs_at"].items())
        lines.append(f"capacity: --max-num-seqs {c['max_num_seqs']}{memory} ({c['note']}); the cache holds {held} "
                     f"tokens" + (f"; see {c['command']}" if c["command"] else ""))
    elif c:
        lines.append(f"capacity: {c['note']}")
    if p["canary"]:
        lines.append(f"canary: Rollout over the Deployment, 10% -> 50% -> 100% with an AnalysisTemplate; "
                     f"kubectl apply -k {out}/canary")
    lines.append(f"dashboard: {out}/monitoring/grafana-dashboard.yaml, a ConfigMap with label grafana_dashboard=1 "
                 "for Grafana's sidecar (latency percentiles, queue, KV cache, tokens/s, errors, canary vs stable, "
                 "cold start)")
    lines.append(f"validated offline; next: kubectl apply -k {out}/base; later: quantship deploy verify "
                 f"{m['source']} --sums {out}")
    return lines
