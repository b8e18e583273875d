"""Ship: manifests that validate offline, broken ones that do not (and say where), promtool on the
rules, SHA256SUMS and version checks, and the canary gate against a real Prometheus."""

import json
import shutil
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from quantship.cli import main
from quantship.deploy import generate as generate_module
from quantship.deploy.canary import load_rules
from quantship.deploy.model import count_parameters, estimate_size, read_model
from quantship.deploy.serving import serving_plan
from quantship.deploy.sizing import startup
from quantship.deploy.validate import validate_dir
from quantship.deploy.versions import compatible, parse, satisfies
from quantship.errors import QuantshipError
from quantship.models.bundled import TINY_DIR
from quantship.models.config import load_config

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (Debian package prometheus)")

# DeepSeek-V3's published config.json, quantized W4A16 (group 128) as `quantship quantize` writes it: no weights.
V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
    "rope_theta": 10000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                          "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                          "type": "yarn"},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
         "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
             "num_bits": 4, "type": "int", "symmetric": True, "group_size": 128, "strategy": "group",
             "actorder": None, "dynamic": False}}},
         "ignore": ["lm_head", "re:.*mlp.gate$"]}


def describe(directory: Path, **extra) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**V3_CONFIG, **extra}, indent=2))
    return directory


@pytest.fixture(scope="module")
def v3(tmp_path_factory) -> Path:
    return describe(tmp_path_factory.mktemp("models") / "deepseek-v3-w4a16", quantization_config=W4A16)


def deploy(model, out: Path, *args) -> Path:
    assert main(["deploy", str(model), "-o", str(out), *args]) == 0
    return out


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


# --- generation and validation ------------------------------------------------------------------------------

@pytest.mark.parametrize("autoscaler", ["hpa", "keda"])
@pytest.mark.parametrize("canary", [False, True])
@pytest.mark.parametrize("which", ["tiny", "v3"])
def test_generated_manifests_validate(which, autoscaler, canary, v3, tmp_path, capsys):
    model, extra = ("tiny", ["--gpus", "0"]) if which == "tiny" else (v3, ["--engine", "vllm"])
    out = deploy(model, tmp_path / "k8s", "--autoscaler", autoscaler, *(["--canary"] if canary else []), *extra)
    assert "wrote" in capsys.readouterr().out
    report = validate_dir(out)
    assert report.problems == []
    assert (out / "base" / ("hpa.yaml" if autoscaler == "hpa" else "scaledobject.yaml")).is_file()
    assert (out / "monitoring" / "prometheus-adapter-rules.yaml").is_file() == (autoscaler == "hpa")
    assert (out / "canary" / "rollout.yaml").is_file() == canary
    assert {"Dockerfile", "SHA256SUMS", "quantship-manifest.json"} <= {p.name for p in out.iterdir()}
    pod = load(out / "base" / "deployment.yaml")["spec"]["template"]["spec"]
    server = pod["containers"][0]
    assert server["resources"]["requests"] == server["resources"]["limits"]
    assert server["livenessProbe"]["httpGet"]["path"] == "/health"
    if which == "v3":
        assert server["resources"]["limits"]["nvidia.com/gpu"] == "8"  # 349 GB of W4A16 weights on 80 GB GPUs
        assert server["image"].startswith("vllm/vllm-openai:") and "--tensor-parallel-size" in server["args"]
        assert "--quantization" not in server["args"]  # vLLM reads compressed-tensors from config.json
        assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
        probe = server["startupProbe"]
        assert probe["failureThreshold"] * probe["periodSeconds"] >= 349e9 / 250e6 + 300
    else:
        assert "nvidia.com/gpu" not in server["resources"]["limits"] and "tolerations" not in pod
        assert server["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert main(["deploy", "validate", str(out)]) == 0
    assert "valid" in capsys.readouterr().out


def test_model_facts_and_sizing(v3, tmp_path):
    layers, rest = count_parameters(load_config(TINY_DIR))
    tiny = read_model("tiny")
    assert layers + rest == tiny.parameters and tiny.size_source == "weights on disk"
    size, params = estimate_size(load_config(v3))
    assert params == 671_026_404_352  # DeepSeek-V3 without its MTP layer
    assert 340e9 < size < 360e9  # 4 bits + a bf16 scale per 128 weights; embeddings and lm_head in bf16
    # The capacity planner picks the GPUs: the fewest (a power of two) whose memory holds the weights
    # and at least one sequence of the served context.
    assert serving_plan(str(v3), "NVIDIA-H100-80GB-HBM3", None, "vllm", 32768, 128).gpus == 8
    assert serving_plan(str(v3), "NVIDIA-H200", None, "vllm", 32768, 128).gpus == 4
    bf16 = describe(tmp_path / "deepseek-v3-bf16")
    assert read_model(bf16).size_bytes > 1.3e12
    with pytest.raises(QuantshipError, match="does not fit 8 x NVIDIA-H100-80GB-HBM3"):
        serving_plan(str(bf16), "NVIDIA-H100-80GB-HBM3", None, "vllm", 32768, 128)
    s = startup(int(100e9), 250.0, "vllm")  # 400 s to read + 300 s warm-up, times 1.5
    assert (s.load_estimate_s, s.budget_s, s.failure_threshold) == (700, 1050, 105)
    assert read_model(v3, size_gb=400).size_bytes == 400e9


def test_deploy_refuses_to_overwrite_and_leaves_nothing_half_written(v3, tmp_path, monkeypatch, capsys):
    out = deploy("tiny", tmp_path / "k8s", "--gpus", "0")
    assert main(["deploy", "tiny", "-o", str(out)]) == 2 and "exists" in capsys.readouterr().err
    assert main(["deploy", "tiny", "-o", str(tmp_path / "x"), "--name", "Tiny_Model"]) == 2
    assert "'tiny-model'" in capsys.readouterr().err
    # bf16 DeepSeek-V3 does not fit 8 GPUs: an input error, and no directory appears.
    bf16 = describe(tmp_path / "deepseek-v3-bf16")
    assert main(["deploy", str(bf16), "-o", str(tmp_path / "big"), "--engine", "vllm"]) == 2
    assert "quantize the model" in capsys.readouterr().err
    # A failure after files were written (here: validation) removes the partial directory.
    import quantship.deploy.validate as validate_module

    real = validate_module.validate_dir
    monkeypatch.setattr(validate_module, "validate_dir", lambda d: type("R", (), {"problems": ["boom"]})())
    with pytest.raises(RuntimeError, match="boom"):
        generate_module.generate("tiny", tmp_path / "half", generate_module.DeployOptions(gpus=0))
    monkeypatch.setattr(validate_module, "validate_dir", real)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deepseek-v3-bf16", "k8s"]


# --- broken variants fail, naming file, object and field -----------------------------------------------------

def _edit(path: Path, old: str, new: str, count: int = 1) -> None:
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, count))


def _add_unknown_kind(out: Path) -> None:
    (out / "base" / "widget.yaml").write_text("apiVersion: example.com/v1\nkind: Widget\nmetadata:\n  name: w\n")
    _edit(out / "base" / "kustomization.yaml", "- pdb.yaml", "- pdb.yaml\n- widget.yaml")


BROKEN = {
    "probe typo": (lambda o: _edit(o / "base" / "deployment.yaml", "failureThreshold: 4", "failureTreshold: 4"),
                   "base/deployment.yaml: Deployment/tiny: spec.template.spec.containers[0].startupProbe."
                   "failureTreshold: unknown field"),
    "requests != limits": (lambda o: _edit(o / "base" / "deployment.yaml", "memory: 3Gi", "memory: 4Gi", 2) or
                           _edit(o / "base" / "deployment.yaml", "memory: 4Gi", "memory: 3Gi"),
                           "spec.template.spec.containers[0].resources.requests.memory: 3Gi differs from limits.memory "
                           "4Gi: Guaranteed QoS"),
    "missing adapter metric": (lambda o: (o / "monitoring" / "prometheus-adapter-rules.yaml").unlink(),
                               "base/hpa.yaml: HorizontalPodAutoscaler/tiny: spec.metrics[0].pods.metric.name: "
                               "no prometheus-adapter rule serves 'vllm_num_requests_waiting'"),
    "unknown kind": (_add_unknown_kind, "base/widget.yaml: Widget/w: kind: unknown kind Widget"),
    "startup budget": (lambda o: _edit(o / "base" / "deployment.yaml", "failureThreshold: 4", "failureThreshold: 2"),
                       "startupProbe.failureThreshold: startup budget 20s (initialDelaySeconds + failureThreshold "
                       "× periodSeconds) is below the load estimate 23s"),
    "service selects nothing": (lambda o: _edit(o / "base" / "service.yaml",
                                                "selector:\n    app.kubernetes.io/name: tiny",
                                                "selector:\n    app.kubernetes.io/name: tinny"),
                                "base/service.yaml: Service/tiny: spec.selector: selects no pods"),
    "rollout typo": (lambda o: _edit(o / "canary" / "rollout.yaml", "      steps:", "      stepz:"),
                     "canary/rollout.yaml: Rollout/tiny: spec.strategy.canary.stepz: unknown field"),
    "analysis arg": (lambda o: _edit(o / "canary" / "rollout.yaml", "- name: stable-hash", "- name: stable_hash"),
                     "spec.strategy.canary.analysis.args: missing arg 'stable-hash' that AnalysisTemplate/tiny-canary"),
    "patch target": (lambda o: _edit(o / "canary" / "kustomization.yaml", "    name: tiny", "    name: tiny2"),
                     "canary/kustomization.yaml: patches[0].target: no HorizontalPodAutoscaler/tiny2"),
    "scale-up per cold start": (lambda o: _edit(o / "base" / "hpa.yaml", "periodSeconds: 60", "periodSeconds: 15"),
                                "spec.behavior.scaleUp.policies[0].periodSeconds: 15s is shorter than the cold start"),
    # What the schemas leave unbounded and a cluster would refuse or run badly (deploy/bounds.py).
    "negative replicas": (lambda o: _edit(o / "base" / "deployment.yaml", "spec:\n  selector:",
                                          "spec:\n  replicas: -1\n  selector:"),
                          "base/deployment.yaml: Deployment/tiny: spec.replicas: -1 is negative"),
    "hpa min 0": (lambda o: _edit(o / "base" / "hpa.yaml", "minReplicas: 1", "minReplicas: 0"),
                  "base/hpa.yaml: HorizontalPodAutoscaler/tiny: spec.minReplicas: 0 is below 1"),
    "hpa min > max": (lambda o: _edit(o / "base" / "hpa.yaml", "minReplicas: 1", "minReplicas: 5"),
                      "spec.minReplicas: 5 is above maxReplicas 4: the range is empty"),
    "cuda without a GPU": (lambda o: _edit(o / "base" / "deployment.yaml", "- --device\n        - cpu",
                                           "- --device\n        - cuda"),
                           "Deployment/tiny: spec.template.spec.containers: the pod expects a GPU (container server "
                           "runs with --device cuda) but no container has resources.limits.nvidia.com/gpu"),
    "bad quantity": (lambda o: _edit(o / "base" / "deployment.yaml", "memory: 3Gi", "memory: lots", 2),
                     "spec.template.spec.containers[0].resources.limits.memory: 'lots' is not a valid quantity"),
    "drain blocked": (lambda o: _edit(o / "base" / "pdb.yaml", "maxUnavailable: 1", "maxUnavailable: 0"),
                      "base/pdb.yaml: PodDisruptionBudget/tiny: spec.maxUnavailable: 0 forbids every eviction"),
    "negative probe period": (lambda o: _edit(o / "base" / "deployment.yaml", "periodSeconds: 10",
                                              "periodSeconds: -10"),
                              "containers[0].startupProbe.periodSeconds: -10 is negative"),
    # The API server's rules for names, labels and ports (deploy/object_meta.py).
    "service name": (lambda o: _edit(o / "base" / "service.yaml", "  name: tiny\n", "  name: Tiny_Service\n"),
                     "Service/Tiny_Service: metadata.name: 'Tiny_Service' is not a DNS-1035 label"),
    "label value": (lambda o: _edit(o / "base" / "pdb.yaml", "app.kubernetes.io/version: 0.1.0",
                                    "app.kubernetes.io/version: 0.1.0 (edited)"),
                    "PodDisruptionBudget/tiny: metadata.labels['app.kubernetes.io/version']: label value "
                    "'0.1.0 (edited)' is not valid"),
    "annotation key": (lambda o: _edit(o / "base" / "deployment.yaml", "    quantship.io/version:",
                                       "    quantship.io/bad key:"),
                       "Deployment/tiny: metadata.annotations['quantship.io/bad key']: annotation key is not a "
                       "qualified name"),
    "probe port": (lambda o: _edit(o / "base" / "deployment.yaml", "port: http", "port: htp", 1),
                   "containers[0].startupProbe.httpGet.port: no port named 'htp' in this container"),
    "empty image": (lambda o: _edit(o / "base" / "deployment.yaml", "image: quantship-server:0.1.0", "image: ''"),
                    "spec.template.spec.containers[0].image: empty"),
}


@pytest.fixture(scope="module")
def good_tiny(tmp_path_factory) -> Path:
    return deploy("tiny", tmp_path_factory.mktemp("good") / "k8s", "--gpus", "0", "--canary")


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_variants_fail_with_the_field(case, good_tiny, tmp_path, capsys):
    out = tmp_path / "k8s"
    shutil.copytree(good_tiny, out)
    mutate, expected = BROKEN[case]
    mutate(out)
    problems = validate_dir(out).problems
    assert any(expected in p for p in problems), problems
    assert main(["deploy", "validate", str(out)]) == 1
    assert expected in capsys.readouterr().out


def test_a_gpu_pod_without_its_gpu_request_and_an_empty_directory_fail(tmp_path, capsys):
    out = deploy("tiny", tmp_path / "gpu", "--gpus", "1")
    _edit(out / "base" / "deployment.yaml", "            nvidia.com/gpu: '1'\n", "", 2)  # affinity and toleration stay
    problems = validate_dir(out).problems
    assert any("Deployment/tiny: spec.template.spec.containers: the pod expects a GPU" in p for p in problems), problems
    (tmp_path / "empty").mkdir()
    assert main(["deploy", "validate", str(tmp_path / "empty")]) == 1
    assert "no Kubernetes objects found" in capsys.readouterr().out


def test_keda_and_rules_errors_point_at_fields(v3, tmp_path):
    out = deploy(v3, tmp_path / "k8s", "--engine", "vllm", "--autoscaler", "keda")
    _edit(out / "base" / "scaledobject.yaml", "threshold: '5'", "threshold: five")
    assert any("base/scaledobject.yaml: ScaledObject/deepseek-v3-w4a16: spec.triggers[0].metadata.threshold" in p
               for p in validate_dir(out).problems)
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - name: x\n    query: up{$selector}\n    max_ration: 2\n")
    with pytest.raises(QuantshipError, match=r"rules\[0\]\.max_ration: unknown field"):
        load_rules(rules)


# --- Prometheus rules: promtool check and unit tests of the alerts ------------------------------------------

ALERT_TESTS = """
rule_files: [{rules}]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      # 100 requests a minute, every first token after more than 2.5 s: p99 TTFT above the 2 s SLO.
      - series: 'vllm:time_to_first_token_seconds_bucket{{model_name="tiny",le="1"}}'
        values: '0+0x30'
      - series: 'vllm:time_to_first_token_seconds_bucket{{model_name="tiny",le="5"}}'
        values: '0+100x30'
      - series: 'vllm:time_to_first_token_seconds_bucket{{model_name="tiny",le="+Inf"}}'
        values: '0+100x30'
      # 10% of /v1 requests answered 5xx, from a pod that serves this model.
      - series: 'http_requests_total{{handler="/v1/completions",method="POST",status="2xx",instance="a"}}'
        values: '0+90x30'
      - series: 'http_requests_total{{handler="/v1/completions",method="POST",status="5xx",instance="a"}}'
        values: '0+10x30'
      - series: 'vllm:num_requests_running{{model_name="tiny",instance="a"}}'
        values: '4x30'
      # 30 waiting per replica, against a target of 5: the autoscaler is not keeping up.
      - series: 'vllm:num_requests_waiting{{model_name="tiny",instance="a"}}'
        values: '30x30'
    alert_rule_test:
      - eval_time: 5m
        alertname: QuantshipTTFTHigh
        exp_alerts: []
      - eval_time: 20m
        alertname: QuantshipTTFTHigh
        exp_alerts:
          - exp_labels: {{severity: warning, model_name: tiny}}
            exp_annotations:
              summary: 'tiny: p99 time to first token above 2s for 10 minutes'
              description: 'p99 TTFT is 4.96s.'
      - eval_time: 20m
        alertname: QuantshipErrorRatioHigh
        exp_alerts:
          - exp_labels: {{severity: critical, model_name: tiny}}
            exp_annotations:
              summary: 'tiny: more than 1% of API requests fail (5xx)'
              description: 'error ratio is 10%.'
      - eval_time: 10m
        alertname: QuantshipQueueBacklog
        exp_alerts: []
      - eval_time: 20m
        alertname: QuantshipQueueBacklog
        exp_alerts:
          - exp_labels: {{severity: warning, model_name: tiny}}
            exp_annotations:
              summary: 'tiny: requests keep waiting although the autoscaler had time to add replicas'
              description: '30 requests waiting per replica.'
      - eval_time: 20m
        alertname: QuantshipMetricsAbsent
        exp_alerts: []
  - interval: 1m
    input_series:
      # Healthy: fast first tokens, no errors (so no 5xx series at all), a short queue.
      - series: 'vllm:time_to_first_token_seconds_bucket{{model_name="tiny",le="0.1"}}'
        values: '0+100x30'
      - series: 'vllm:time_to_first_token_seconds_bucket{{model_name="tiny",le="+Inf"}}'
        values: '0+100x30'
      - series: 'http_requests_total{{handler="/v1/completions",method="POST",status="2xx",instance="a"}}'
        values: '0+100x30'
      - series: 'vllm:num_requests_running{{model_name="tiny",instance="a"}}'
        values: '4x30'
      - series: 'vllm:num_requests_waiting{{model_name="tiny",instance="a"}}'
        values: '1x30'
    promql_expr_test:
      - expr: quantship:error_ratio:rate5m
        eval_time: 20m
        exp_samples:
          - labels: 'quantship:error_ratio:rate5m{{model_name="tiny"}}'
            value: 0
    alert_rule_test:
      - {{eval_time: 25m, alertname: QuantshipTTFTHigh, exp_alerts: []}}
      - {{eval_time: 25m, alertname: QuantshipErrorRatioHigh, exp_alerts: []}}
      - {{eval_time: 25m, alertname: QuantshipQueueBacklog, exp_alerts: []}}
      - {{eval_time: 25m, alertname: QuantshipMetricsAbsent, exp_alerts: []}}
  - interval: 1m
    input_series: []
    alert_rule_test:
      - {{eval_time: 5m, alertname: QuantshipMetricsAbsent, exp_alerts: []}}
      - eval_time: 15m
        alertname: QuantshipMetricsAbsent
        exp_alerts:
          - exp_labels: {{severity: critical, model_name: tiny}}
            exp_annotations:
              summary: 'tiny: no replica reports serving metrics'
"""


@needs_promtool
def test_promtool_checks_and_tests_the_rules(good_tiny, tmp_path):
    rules = good_tiny / "monitoring" / "prometheus-rules.yaml"
    check = subprocess.run([PROMTOOL, "check", "rules", str(rules)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    tests = tmp_path / "rules_test.yaml"
    tests.write_text(ALERT_TESTS.format(rules=json.dumps(str(rules))))
    run = subprocess.run([PROMTOOL, "test", "rules", str(tests)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


@needs_promtool
def test_validate_parses_every_dashboard_query(good_tiny, tmp_path):
    """The Grafana dashboard ConfigMap (label grafana_dashboard) has its panels' PromQL checked by promtool;
    a broken one is named. (test_canary_e2e runs every query against a real Prometheus.)"""
    board = yaml.safe_load((good_tiny / "monitoring" / "grafana-dashboard.yaml").read_text())
    assert board["kind"] == "ConfigMap" and board["metadata"]["labels"]["grafana_dashboard"] == "1"
    report = validate_dir(good_tiny)
    assert any("dashboard queries passed promtool check rules" in n for n in report.notes)
    broken = tmp_path / "k8s"
    shutil.copytree(good_tiny, broken)
    _edit(broken / "monitoring" / "grafana-dashboard.yaml", "histogram_quantile(0.5,", "histogram_quantile(0.5,,")
    assert any("ConfigMap/tiny-grafana-dashboard: a panel's PromQL does not parse" in p
               for p in validate_dir(broken).problems)


# --- SHA256SUMS and versions ---------------------------------------------------------------------------------

def test_verify_passes_fresh_and_fails_on_one_changed_byte(tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(TINY_DIR, model)
    out = deploy(model, tmp_path / "k8s", "--gpus", "0")
    assert main(["deploy", "verify", str(model), "--sums", str(out)]) == 0
    assert "verdict: PASS" in capsys.readouterr().out
    shard = model / "model-00002-of-00003.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01  # one byte of tensor data; the header still parses
    shard.write_bytes(bytes(data))
    assert main(["deploy", "verify", str(model), "--sums", str(out / "SHA256SUMS")]) == 1
    printed = capsys.readouterr().out
    assert "FAIL model-00002-of-00003.safetensors: SHA-256 differs" in printed and "verdict: FAIL" in printed
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    (model / "added.json").write_text("{}")
    assert main(["deploy", "verify", str(model), "--sums", str(out)]) == 1
    assert "added.json: model file not listed" in capsys.readouterr().out
    assert main(["deploy", "verify", str(model)]) == 2  # no SHA256SUMS next to the model
    assert "no SHA256SUMS" in capsys.readouterr().err


def test_verify_warns_on_a_file_added_after_the_deploy_and_strict_fails(tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(TINY_DIR, model)
    out = deploy(model, tmp_path / "k8s", "--gpus", "0")
    assert main(["deploy", "verify", str(model), "--sums", str(out), "--strict"]) == 0  # every file was listed
    (model / "pytorch_model.bin").write_bytes(b"a pickle a loader might prefer")
    assert main(["deploy", "verify", str(model), "--sums", str(out)]) == 0
    assert "warn pytorch_model.bin: present but not listed" in capsys.readouterr().out
    assert main(["deploy", "verify", str(model), "--sums", str(out), "--strict"]) == 1
    printed = capsys.readouterr().out
    assert "FAIL pytorch_model.bin: present but not listed" in printed and "verdict: FAIL" in printed


def test_verify_checks_the_writer_version(tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(TINY_DIR, model)
    (model / "quantship_recipe.json").write_text(json.dumps({"quantship_version": "0.1.0"}))
    out = deploy(model, tmp_path / "k8s", "--gpus", "0")
    assert json.loads((out / "quantship-manifest.json").read_text())["checkpoint"]["written_by"] == "0.1.0"
    assert main(["deploy", "verify", str(model), "--sums", str(out)]) == 0
    (model / "quantship_recipe.json").write_text(json.dumps({"quantship_version": "0.3.0"}))
    (out / "SHA256SUMS").write_text(generate_module.sums_text(model, read_model(model).files))
    assert main(["deploy", "verify", str(model), "--sums", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "written_by is 0.3.0" in printed and "upgrade quantship" in printed


@pytest.mark.parametrize("code,writer,fmt,ok", [
    ("0.1.0", "0.1.0", "compressed-tensors/pack-quantized", True),
    ("0.1.7", "0.1.2", "compressed-tensors/pack-quantized", True),
    ("0.1.2", "0.1.7", "safetensors", True),  # patch releases read each other
    ("0.1.0", "0.2.0", "compressed-tensors/pack-quantized", False),  # written by a newer minor
    ("0.1.0", "0.0.9", "safetensors", False),
    ("0.2.0", "0.1.0", "safetensors", False),  # no row for this code version
    ("0.1.0", None, "safetensors", True),  # another tool's checkpoint: judged by format
    ("0.1.0", None, "gguf", False),
    ("0.1.0", "0.1.0-rc.1", "safetensors", False),  # a pre-release sorts before its release
])
def test_version_matrix(code, writer, fmt, ok):
    assert compatible(code, writer, fmt)[0] is ok


def test_semantic_versions():
    assert parse("1.0.0-alpha") < parse("1.0.0-alpha.1") < parse("1.0.0-beta") < parse("1.0.0") < parse("1.0.1")
    assert parse("1.0.0-2") < parse("1.0.0-10") and parse("v2.0.0+build.5") == parse("2.0.0")
    assert satisfies("0.1.5", ">=0.1.0 <0.2.0") and not satisfies("0.2.0", ">=0.1.0 <0.2.0")
    with pytest.raises(QuantshipError, match="not a semantic version"):
        parse("0.1")


# --- gate canary against a real Prometheus -------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Each path is one fake server: (first-token seconds, share of 5xx answers). 50 requests a second.
FAKE_SERVERS = {"baseline": (0.05, 0.0), "canary_ok": (0.05, 0.0), "canary_slow": (0.4, 0.0),
                "canary_errors": (0.05, 0.1)}
BUCKETS = (0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0)


def _exposition(ttft: float, error_share: float, elapsed: float) -> str:
    n = int(elapsed * 50)
    lines = ["# TYPE vllm:time_to_first_token_seconds histogram"]
    for le in BUCKETS:
        lines.append(f'vllm:time_to_first_token_seconds_bucket{{model_name="tiny",le="{le}"}} {n if ttft <= le else 0}')
    lines += [f'vllm:time_to_first_token_seconds_bucket{{model_name="tiny",le="+Inf"}} {n}',
              f'vllm:time_to_first_token_seconds_count{{model_name="tiny"}} {n}',
              f'vllm:time_to_first_token_seconds_sum{{model_name="tiny"}} {n * ttft}',
              "# TYPE http_requests_total counter",
              f'http_requests_total{{handler="/v1/completions",method="POST",status="2xx"}} {n - int(n * error_share)}']
    if error_share:  # like prometheus-client, the 5xx series only exists after a first error
        lines.append('http_requests_total{handler="/v1/completions",method="POST",status="5xx"} '
                     f"{int(n * error_share)}")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    """Debian's Prometheus on loopback, its own data directory, scraping fake vLLM-named exporters every second."""
    if PROMETHEUS is None:
        pytest.skip("needs prometheus (Debian package prometheus)")
    started = time.time()

    class Exporter(BaseHTTPRequestHandler):
        def do_GET(self):
            ttft, errors = FAKE_SERVERS[self.path.strip("/")]
            body = _exposition(ttft, errors, time.time() - started).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    exporter = ThreadingHTTPServer(("127.0.0.1", 0), Exporter)
    threading.Thread(target=exporter.serve_forever, daemon=True).start()
    work = tmp_path_factory.mktemp("prometheus")
    jobs = [{"job_name": name, "metrics_path": f"/{name}", "scrape_interval": "1s",
             "static_configs": [{"targets": [f"127.0.0.1:{exporter.server_address[1]}"]}]} for name in FAKE_SERVERS]
    (work / "prometheus.yml").write_text(yaml.safe_dump({"global": {"scrape_interval": "1s"}, "scrape_configs": jobs}))
    port = _free_port()
    log = open(work / "prometheus.log", "w")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={work / 'prometheus.yml'}",
                             f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx

        query = 'count(rate(vllm:time_to_first_token_seconds_count[10s]) > 0)'
        deadline = time.time() + 60
        while True:  # until every job has two scrapes, so rate() has something to say
            assert proc.poll() is None, (work / "prometheus.log").read_text()[-2000:]
            try:
                response = httpx.get(f"{url}/api/v1/query", params={"query": query}, timeout=2)
                # Until its storage is open Prometheus answers 503 "Service Unavailable", not JSON.
                result = response.json()["data"]["result"] if response.status_code == 200 else None
                if result and int(float(result[0]["value"][1])) == len(FAKE_SERVERS):
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "Prometheus did not scrape the exporters in 60 s"
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        exporter.shutdown()
        exporter.server_close()


def gate(url: str, canary: str, *extra) -> int:
    return main(["gate", "canary", "--prometheus", url, "--canary-selector", f'job="{canary}"',
                 "--baseline-selector", 'job="baseline"', "--interval", "1", "--count", "2",
                 "--failure-limit", "0", "--window", "10s", *extra])


def test_gate_canary_on_a_real_prometheus(prometheus, capsys):
    assert gate(prometheus, "canary_ok") == 0
    out = capsys.readouterr().out
    assert "[2/2] ttft_p99: canary" in out and "verdict: PROMOTE" in out
    assert gate(prometheus, "canary_slow") == 1
    assert "verdict: ROLL BACK (ttft_p99 failed 1 of 1 rounds" in capsys.readouterr().out
    assert gate(prometheus, "canary_errors") == 1
    assert "verdict: ROLL BACK (error_rate failed" in capsys.readouterr().out
    assert gate(prometheus, "absent") == 2
    assert "verdict: INCONCLUSIVE (no data for ttft_p99, error_rate" in capsys.readouterr().out
    assert gate(prometheus, "canary_slow", "--json", "--count", "1") == 1
    result = json.loads(capsys.readouterr().out)
    assert result["verdict"] == "ROLL BACK" and result["rules"][0]["measurements"][0]["canary"] > 0.3


def test_gate_canary_input_errors(capsys):
    assert main(["gate", "canary", "--prometheus", f"http://127.0.0.1:{_free_port()}", "--canary-selector",
                 'job="c"', "--baseline-selector", 'job="b"', "--count", "1"]) == 2
    assert "did not answer" in capsys.readouterr().err
    assert main(["gate", "canary", "--prometheus", "http://127.0.0.1:1"]) == 2
    assert "no canary selector" in capsys.readouterr().err
