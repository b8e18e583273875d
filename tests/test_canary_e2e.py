"""Ship's end-to-end proof: a real Prometheus scrapes real `quantship serve` processes (a baseline,
a healthy canary, a bad canary made slower and failing), `quantship bench` drives their load, and
`quantship gate canary` promotes the healthy one and rolls back each bad one for its own fault.
The Grafana dashboard `quantship deploy` writes is checked against the same Prometheus: every
panel's query parses (promtool) and returns data."""

import math
import os
import shutil
import socket
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from quantship.cli import main
from quantship.deploy.dashboard import HASH, as_rules, dashboard_queries

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="needs prometheus (Debian package prometheus)")

# This must hold on two CPU cores shared with other work, where queueing alone has pushed a
# baseline's TTFT p99 to 2.5 s. So the slow canary's fault is large against anything queueing adds:
# 10 s puts all its first tokens in the 10-20 s histogram bucket (p99 ~20 s), above the rule's limit
# (3 x baseline + 4 s) unless the baseline's own p99 exceeds ~5.3 s. Its load is ten requests at
# once, so the fault costs ~10 s of wall time, not 40 x 10 s. Identical servers may still land in
# different latency buckets (p99 0.5 s against 2.5 s): max_delta keeps the healthy canary's
# comparison from hinging on that.
# name → (extra `quantship serve` flags, `quantship bench` load)
STEADY = ["--concurrency", "2", "--requests", "40"]
SERVERS = {
    "baseline": ([], STEADY),
    "canary_ok": ([], STEADY),
    "canary_slow": (["--inject-latency-ms", "10000"], ["--concurrency", "10", "--requests", "10"]),
    "canary_errors": (["--inject-error-rate", "0.2"], STEADY),
}
RULES = {"window": "5m", "rules": [
    {"name": "ttft_p99", "max_ratio": 3.0, "max_delta": 4.0,
     "query": "histogram_quantile(0.99, sum by (le) "
              "(rate(vllm:time_to_first_token_seconds_bucket{$selector}[$window])))"},
    {"name": "error_rate", "max_delta": 0.02,
     "query": '(sum(rate(http_requests_total{$selector,handler=~"/v1/.*",status=~"5.."}[$window])) or vector(0))'
              ' / sum(rate(http_requests_total{$selector,handler=~"/v1/.*"}[$window]))'},
]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(check, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except (httpx.HTTPError, ValueError):  # not up yet, or a 503 page where JSON will be (Prometheus starting)
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Four servers and a Prometheus scraping them every second; everything stopped afterwards."""
    work = tmp_path_factory.mktemp("canary")
    procs, urls = [], {}
    # One intra-op thread per server: four servers each spinning two threads on two cores only add
    # contention to what the test measures.
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    try:
        for name, (flags, _) in SERVERS.items():
            port = free_port()
            urls[name] = f"http://127.0.0.1:{port}"
            log = open(work / f"{name}.log", "w")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "quantship.cli", "serve", "tiny", "--port", str(port), "--max-model-len", "512",
                 *flags], stdout=log, stderr=subprocess.STDOUT, env=env))
        # Each server stands for a revision of an Argo rollout: the pod label Prometheus keeps in a cluster.
        jobs = [{"job_name": name, "scrape_interval": "1s",
                 "static_configs": [{"targets": [url.split("//")[1]], "labels": {HASH: name}}]}
                for name, url in urls.items()]
        (work / "prometheus.yml").write_text(yaml.safe_dump({"scrape_configs": jobs}))
        prom_url = f"http://127.0.0.1:{free_port()}"
        procs.append(subprocess.Popen(
            [PROMETHEUS, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'tsdb'}",
             f"--web.listen-address={prom_url.split('//')[1]}"],
            stdout=open(work / "prometheus.log", "w"), stderr=subprocess.STDOUT))
        for name, url in urls.items():
            wait_until(lambda url=url: httpx.get(f"{url}/ready", timeout=2).status_code == 200, f"{name} /ready",
                       timeout=300)  # four model loads at once on a busy machine
        yield urls, prom_url, work
    finally:
        for proc in procs:
            stop(proc)


def test_gate_promotes_a_healthy_canary_and_rolls_back_a_bad_one(fleet, capsys):
    urls, prom_url, work = fleet
    # Load on all of them at once, as a canary and its baseline see it in production.
    benches = [subprocess.Popen([sys.executable, "-m", "quantship.cli", "bench", url, "--profile", "concurrent",
                                 *SERVERS[name][1], "--input-len", "32", "--output-len", "8",
                                 "-o", str(work / f"bench-{name}")], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
               for name, url in urls.items()]
    codes = [b.wait(timeout=600) for b in benches]
    assert codes == [0] * len(SERVERS)

    def scraped_everything() -> bool:
        query = "sum by (job) (vllm:time_to_first_token_seconds_count)"
        result = httpx.get(f"{prom_url}/api/v1/query", params={"query": query}, timeout=2).json()["data"]["result"]
        counts = {r["metric"]["job"]: float(r["value"][1]) for r in result}
        expected = {name: float(metric_count(url)) for name, url in urls.items()}
        return counts == expected and all(v > 0 for v in counts.values())

    wait_until(scraped_everything, "Prometheus to scrape the finished load", timeout=60)
    rules = work / "rules.yaml"
    rules.write_text(yaml.safe_dump(RULES))

    def gate(canary: str) -> int:
        return main(["gate", "canary", "--prometheus", prom_url, "--rules", str(rules),
                     "--canary-selector", f'job="{canary}"', "--baseline-selector", 'job="baseline"',
                     "--interval", "1", "--count", "2", "--failure-limit", "0"])

    # The gate's own report of every round (measured values and limits) is the failure message.
    assert gate("canary_ok") == 0 and "PROMOTE" in (out := capsys.readouterr().out), out
    assert gate("canary_slow") == 1 and "ROLL BACK (ttft_p99 failed" in (out := capsys.readouterr().out), out
    assert gate("canary_errors") == 1 and "ROLL BACK (error_rate failed" in (out := capsys.readouterr().out), out


def metric_count(url: str) -> float:
    """The server's own count of first tokens, to know when Prometheus has caught up."""
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("vllm:time_to_first_token_seconds_count"):
            return float(line.split()[-1])
    return 0.0


def test_every_dashboard_panel_parses_and_returns_data(fleet, tmp_path):
    urls, prom_url, work = fleet
    idle = [name for name, url in urls.items() if metric_count(url) == 0]  # run alone: make some load first
    benches = [subprocess.Popen([sys.executable, "-m", "quantship.cli", "bench", urls[name], "--profile", "concurrent",
                                 "--concurrency", "2", "--requests", "8", "--input-len", "32", "--output-len", "8",
                                 "-o", str(work / f"dash-{name}")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for name in idle]
    assert [b.wait(timeout=600) for b in benches] == [0] * len(idle)
    assert main(["deploy", "tiny", "-o", str(tmp_path / "k8s"), "--gpus", "0", "--canary"]) == 0
    board = yaml.safe_load((tmp_path / "k8s" / "monitoring" / "grafana-dashboard.yaml").read_text())
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    queries = dashboard_queries(board)
    titles = {title for title, _ in queries}
    for wanted in ("Time to first token", "Time per output token", "Inter-token latency", "End-to-end request latency",
                   "Requests waiting and running", "KV-cache usage", "Tokens per second",
                   "Error rate (5xx share of /v1 answers)", "Canary vs stable: p99 time to first token",
                   "Canary vs stable: error rate", "Cold start by phase"):
        assert wanted in titles
    rules = tmp_path / "panels.yaml"
    rules.write_text(yaml.safe_dump(as_rules(queries)))
    check = subprocess.run([shutil.which("promtool"), "check", "rules", str(rules)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr

    def values(expr: str) -> list[tuple[dict, float]]:
        body = httpx.get(f"{prom_url}/api/v1/query", params={"query": expr.replace("$__rate_interval", "5m")},
                         timeout=10).json()
        assert body["status"] == "success", (expr, body)
        return [(r["metric"], float(r["value"][1])) for r in body["data"]["result"]]

    def all_have_data() -> bool:
        return all(any(math.isfinite(v) for _, v in values(expr)) for _, expr in queries)

    wait_until(all_have_data, "every dashboard panel to return data", timeout=60)
    by_revision = values(dict((t, e) for t, e in queries)["Canary vs stable: error rate"])
    errors = {m[HASH]: v for m, v in by_revision}
    assert set(errors) == set(urls) and errors["canary_errors"] > 0 and errors["baseline"] == 0
