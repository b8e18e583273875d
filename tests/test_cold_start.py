"""Cold start: the phases a real `quantship serve` process logs and exports add up to its time to
ready, agree with a clock outside the process, and the warm-up leaves no trace in the counters;
deploy sizes the startupProbe from the measured load rate and validate rechecks it."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from test_canary_e2e import free_port, stop

from quantship.cli import main
from quantship.deploy import sizing
from quantship.deploy.validate import validate_dir
from quantship.engine.config import EngineConfig
from quantship.engine.engine import LLMEngine
from quantship.engine.sampling_params import SamplingParams
from quantship.models.bundled import TINY_DIR
from quantship.models.loader import load_model
from quantship.server.startup import PHASES, StartupClock, process_age

ROOT = Path(__file__).resolve().parent.parent


def test_warm_up_leaves_no_trace():
    engine = LLMEngine(load_model(TINY_DIR, torch.float32), EngineConfig(max_model_len=256))
    engine.warm_up()
    s = engine.stats()
    assert (s.prompt_tokens, s.generation_tokens, s.prefix_cache_queries, s.prefix_cache_hits) == (0, 0, 0, 0)
    assert s.kv_cache_usage == 0 and engine.first_token_at is None and not engine.blocks.cached
    engine.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=3))
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().prompt_tokens == 37 and engine.first_token_at is not None


def test_loading_and_serving_a_model_imports_no_compiler():
    """torch._dynamo takes 2.5-4.5 s to import; a plain load (its meta-device skeleton included), a
    warm-up and a request on CPU must not pull it in."""
    code = ("import sys, torch\n"
            "from quantship.engine.engine import load_engine\n"
            "from quantship.engine.sampling_params import SamplingParams\n"
            "from quantship.models.bundled import TINY_DIR\n"
            "engine = load_engine(TINY_DIR)\n"
            "engine.warm_up()\n"
            "engine.add_request('a', [3, 4, 5], SamplingParams(max_tokens=2))\n"
            "while engine.has_unfinished():\n"
            "    engine.step()\n"
            "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_clock_phases_add_up():
    age = process_age()
    assert age is not None and 0 < age < time.monotonic()
    clock = StartupClock(1.0)
    for name in ("load_weights", "build_cache"):
        with clock.phase(name):
            time.sleep(0.01)
    total = clock.mark_ready()
    assert set(clock.phases) == {"process", "load_weights", "build_cache", "serve"}
    assert clock.phases["process"] >= 0.99 and sum(clock.phases.values()) == pytest.approx(total, abs=1e-6)
    assert "ready" in clock.summary()


def test_serve_logs_and_exports_its_cold_start(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    spawned = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "quantship.cli", "serve", "tiny", "--port", str(port),
                             "--max-model-len", "512"], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.01)
        outside_ready = time.monotonic() - spawned
        before = scrape(url)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 2, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200
        after = scrape(url)
    finally:
        stop(proc)
    phases = after["phases"]
    assert set(phases) == set(PHASES) and all(v >= 0 for v in phases.values())
    ready = after["quantship:startup_to_ready_seconds"]
    assert sum(phases.values()) == pytest.approx(ready, abs=0.02)
    # The server's clock starts at the kernel's process start, a moment after spawning; polling /ready
    # every 10 ms sees it answer a moment after the server marks itself ready.
    assert -0.1 < outside_ready - ready < 2.0, (outside_ready, ready)
    assert phases["process"] > 0.2 and phases["capture_cuda_graphs"] < 0.01  # interpreter and imports; no CUDA
    assert "quantship:startup_to_first_token_seconds" not in before  # the warm-up's token is not a first token
    assert after["quantship:startup_to_first_token_seconds"] > ready
    assert before['vllm:prompt_tokens_total'] == 0  # nor does it count as served
    assert after["quantship:checkpoint_bytes"] == sum(p.stat().st_size for p in TINY_DIR.glob("*.safetensors"))
    text = log.read_text()
    assert re.search(r"cold start: ready [\d.]+s after the process started \(process [\d.]+s, load weights", text)
    assert "cold start: first token" in text and "MB/s of checkpoint" in text


def scrape(url: str) -> dict:
    out = {"phases": {}}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("quantship:startup_seconds{"):
            out["phases"][re.search(r'phase="([^"]+)"', line).group(1)] = float(line.split()[-1])
        elif line.startswith(("quantship:", "vllm:prompt_tokens_total")) and "{" in line:
            out[line.split("{")[0]] = float(line.split()[-1])
    return out


def test_startup_budget_from_the_measured_load_rate(tmp_path, capsys):
    profile = sizing.cold_start_profile("native", "cpu")
    assert profile["load_bytes_per_second"] > 0 and profile["source"]
    s = sizing.startup(int(10e9), 250.0, "native", "cpu")
    expected = 10e9 / 250e6 + 10e9 / float(profile["load_bytes_per_second"]) + float(profile["fixed_seconds"])
    assert s.load_estimate_s == pytest.approx(expected, abs=1) and s.budget_s >= 1.5 * expected
    faster = sizing.startup(int(10e9), 250.0, "native", "cpu", load_rate_mbps=10_000)
    assert faster.load_estimate_s < s.load_estimate_s and faster.source == "--engine-load-rate"
    assert sizing.startup(int(100e9), 250.0, "vllm").load_rate_bytes_per_s is None  # vLLM: not measured here
    # The GPU profile is the H200 measurement, which the benchmark's result file holds.
    gpu = sizing.cold_start_profile("native", "cuda")
    measured = json.loads((ROOT / "benchmarks" / "results" / "cold_start_gpu.json").read_text())
    slowest_bf16 = min(r["load_bytes_per_s"] for e in measured["entries"] if e["label"].endswith("bf16")
                       for r in e["runs"])
    assert gpu["load_bytes_per_second"] <= slowest_bf16 and gpu["fixed_seconds"] >= measured["fit"]["fixed_seconds"]
    assert sizing.startup(int(13.5e9), 2000.0, "native").load_estimate_s >= max(
        r["startup_to_ready_seconds"] for e in measured["entries"] for r in e["runs"])
    out = tmp_path / "k8s"
    assert main(["deploy", "tiny", "-o", str(out), "--gpus", "0"]) == 0
    assert "MB/s loaded" in capsys.readouterr().out
    path = out / "base" / "deployment.yaml"
    deployment = yaml.safe_load(path.read_text())
    notes = deployment["metadata"]["annotations"]
    assert float(notes["quantship.io/engine-load-bytes-per-second"]) == float(profile["load_bytes_per_second"])
    # validate rechecks the budget with the load-rate term: a probe that only covers reading fails.
    read_only = int(notes["quantship.io/model-size-bytes"]) / float(notes["quantship.io/load-bandwidth-bytes-per-second"])
    probe = deployment["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
    probe["failureThreshold"] = max(1, int((read_only + float(notes["quantship.io/warmup-seconds"])) // 10))
    path.write_text(yaml.safe_dump(deployment))
    assert any("startupProbe.failureThreshold" in p and "engine load rate" in p for p in validate_dir(out).problems)
