"""What request tracing costs: served throughput with tracing off and on, against the code before tracing.

Three real `quantship serve` processes on the bundled model run side by side: the reference is the
source tree of REFERENCE (the commit before tracing came in, exported with `git archive`), then the
current tree without tracing, then the current tree with `--otlp-endpoint` to an OTLP/HTTP receiver
in this process (it reads each export, as a collector would). Rounds alternate between the three so
the other work on the machine falls on all of them alike; each round is `quantship bench`'s
concurrent load (8 streams). Reported: median output tokens/s per variant and its ratio to the
reference, with the spread across rounds.

    .venv/bin/python benchmarks/tracing_overhead.py [--device cuda] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from quantship.bench.load import Step, Target, run_step  # noqa: E402
from quantship.bench.prompts import load_bench_tokenizer, synthetic_prompts  # noqa: E402
from quantship.bench.stats import summarize  # noqa: E402

from _report import ROOT, table, update_section, write_result  # noqa: E402

REFERENCE = "a436814"  # the last commit without tracing
REQUESTS, STREAMS, INPUT_LEN, OUTPUT_LEN = 48, 8, 64, 32


class Receiver(http.server.ThreadingHTTPServer):
    def __init__(self):
        self.exports = self.bytes = 0
        super().__init__(("127.0.0.1", 0), self.Handler)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            self.server.exports += 1
            self.server.bytes += len(body)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(src: Path, device: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(src), "HF_HUB_OFFLINE": "1"}
    for name in [n for n in env if n.startswith("OTEL_")]:
        env.pop(name)
    proc = subprocess.Popen([sys.executable, "-m", "quantship.cli", "serve", "tiny", "--port", str(port),
                             "--device", device, "--max-model-len", "256", "--max-num-seqs", str(STREAMS), *extra],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(proc: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server at {url} exited {proc.returncode}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"server at {url} not ready")


def one_round(url: str, prompts) -> float:
    target = Target(f"{url}/v1/completions", "tiny", prompts, OUTPUT_LEN, 120.0, requests=REQUESTS)
    s = summarize(asyncio.run(run_step(target, Step("c", "concurrent", concurrency=STREAMS), asyncio.Event())))
    assert s["failed"] == 0 and s["completed"] == REQUESTS, s
    return s["output_throughput"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    receiver = Receiver()
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{receiver.server_address[1]}"
    reference = Path(tempfile.mkdtemp(prefix="quantship-ref-"))
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", REFERENCE, "src"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(reference)], input=archive.stdout, check=True)
    variants = {"before tracing (reference)": (reference / "src", []), "tracing off": (ROOT / "src", []),
                "tracing on (OTLP/HTTP)": (ROOT / "src", ["--otlp-endpoint", endpoint])}
    servers = {name: start_server(src, args.device, extra) for name, (src, extra) in variants.items()}
    try:
        for proc, url in servers.values():
            wait_ready(proc, url)
        prompts = synthetic_prompts(load_bench_tokenizer(None), INPUT_LEN, REQUESTS)
        for _, url in servers.values():
            one_round(url, prompts[:8])  # warm-up
        rates: dict[str, list[float]] = {name: [] for name in servers}
        for r in range(args.rounds):
            order = list(servers) if r % 2 == 0 else list(reversed(servers))
            for name in order:
                rates[name].append(one_round(servers[name][1], prompts))
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        for proc, _ in servers.values():
            proc.wait(timeout=60)
    ref = statistics.median(rates["before tracing (reference)"])
    rows, results = [], []
    for name, values in rates.items():
        median = statistics.median(values)
        results.append({"variant": name, "output_tokens_per_s": values, "median": median, "ratio": median / ref})
        rows.append([name, f"{median:.1f}", f"{min(values):.1f}-{max(values):.1f}", f"{median / ref:.3f}"])
    data = {"device": args.device, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "reference_commit": REFERENCE, "requests": REQUESTS, "streams": STREAMS, "input_len": INPUT_LEN,
            "output_len": OUTPUT_LEN, "rounds": args.rounds, "otlp_exports": receiver.exports,
            "otlp_bytes": receiver.bytes, "load_average_1m_at_end": os.getloadavg()[0], "results": results}
    write_result(f"tracing_overhead_{args.device}", data)
    md = (f"## Request tracing: throughput with tracing off and on\n\n"
          f"`benchmarks/tracing_overhead.py --device {args.device}`: three `quantship serve` processes on the "
          f"bundled model ({data['machine']}), one from the commit before tracing ({REFERENCE}, the reference), "
          f"one without and one with `--otlp-endpoint` (an OTLP/HTTP receiver in the benchmark process took "
          f"{receiver.exports} exports, {receiver.bytes / 1024:.0f} KiB). {args.rounds} alternating rounds of "
          f"{REQUESTS} requests, {STREAMS} concurrent streams, {INPUT_LEN} prompt and {OUTPUT_LEN} output tokens; "
          f"the median round per variant, its ratio to the reference, and the range over rounds (load average "
          f"{data['load_average_1m_at_end']:.1f} at the end: other work shared the machine).\n\n"
          + table(["variant", "output tokens/s (median)", "range", "ratio to reference"], rows))
    update_section(f"tracing_overhead_{args.device}", md)
    print(md)


if __name__ == "__main__":
    main()
