"""Cold start of `quantship serve`: process start to ready and to the first token, by phase.

Here (CPU, bundled model):
    .venv/bin/python benchmarks/cold_start.py run --where cpu
On the GPU machine (DeepSeek-Coder-6.7B shape, random bf16 weights written to disk first, then the
same quantized W4A16 with RTN; the page cache is warm, as on a node that served the model before):
    PYTHONPATH=src python3 benchmarks/cold_start.py run --where gpu --out $OUT
(`serve` needs fastapi, starlette, uvicorn and pydantic, and quantizing needs compressed-tensors: a GPU
image without them takes their wheels, e.g. `pip download --no-deps` of the versions in this venv.)
Then here: .venv/bin/python benchmarks/cold_start.py render benchmarks/results/cold_start_*.json

Each round starts a fresh server process, polls /ready every 10 ms, sends one request for one token
as soon as it is ready, reads the server's own phases from /metrics (quantship:startup_seconds) and
stops it. The outside clock (Popen to /ready answering 200, to the response) checks the server's.

Start-up has parts that do not grow with the checkpoint (imports, building the first layer imports
parts of torch) and parts that do (loading, the cache, the warm-up's forward pass), so a line is
fitted through two checkpoints of one architecture, the small one and one with LARGE_LAYERS layers of
random weights: time to ready = fixed + bytes / rate. Its rate and fixed seconds are what deploy
sizes its startupProbe with (deploy/startup.yaml).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _report import table, update_section, write_result  # noqa: E402

ROUNDS = 3
LARGE_LAYERS = {"cpu": 64, "gpu": None}  # the bundled model's 8 layers, and 64 of them (random weights)
PHASES = ("process", "load_weights", "build_cache", "capture_cuda_graphs", "warmup", "serve")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str) -> dict:
    import httpx

    out = {"phases": {}}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("quantship:startup_seconds{"):
            phase = line.split('phase="')[1].split('"')[0]
            out["phases"][phase] = float(line.split()[-1])
        for key in ("startup_to_ready_seconds", "startup_to_first_token_seconds", "checkpoint_bytes"):
            if line.startswith(f"quantship:{key}{{"):
                out[key] = float(line.split()[-1])
    return out


def one_round(model: str, device: str, log: Path) -> dict:
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "quantship.cli", "serve", model, "--port", str(port),
                             "--device", device], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        while True:
            try:
                if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}; see {log}")
            time.sleep(0.01)
        ready = time.monotonic() - started
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "def fibonacci(n):", "max_tokens": 1,
                                                        "temperature": 0}, timeout=600)
        r.raise_for_status()
        first = time.monotonic() - started
        return {**scrape(url), "outside_ready_s": ready, "outside_first_token_s": first}
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def measure(label: str, model: str, device: str, work: Path, rounds: int) -> dict:
    runs = [one_round(model, device, work / f"{label}-{i}.log") for i in range(rounds)]
    for run in runs:
        run["load_bytes_per_s"] = run["checkpoint_bytes"] / run["phases"]["load_weights"]
    print(label, json.dumps(runs[-1]), flush=True)
    return {"label": label, "model": model, "device": device, "runs": runs}


def run(where: str, out: Path, workdir: Path, rounds: int) -> None:
    import torch
    from quantize_speed import SHAPES, write_checkpoint

    from quantship.models.bundled import TINY_DIR

    entries: list[dict] = []

    def save() -> None:  # after every model: a run cut short keeps the models it finished
        result = {"where": where, "rounds": rounds, "torch": torch.__version__, "cpus": os.cpu_count(),
                  "load_average": os.getloadavg(), "entries": entries,
                  "fit": fit(entries[0], entries[1]) if len(entries) > 1 else None,
                  "device": torch.cuda.get_device_name() if where == "gpu" else "cpu"}
        out.mkdir(parents=True, exist_ok=True)
        (out / f"cold_start_{where}.json").write_text(json.dumps(result, indent=2))
        if result["fit"]:
            print("fit", json.dumps(result["fit"]), flush=True)

    if where == "cpu":
        SHAPES["tiny"] = json.loads((TINY_DIR / "config.json").read_text())
        large = workdir / f"tiny-{LARGE_LAYERS['cpu']}-layers"
        if not (large / "config.json").exists():
            write_checkpoint("tiny", LARGE_LAYERS["cpu"], large)
        entries.append(measure("tiny (8 layers)", "tiny", "cpu", workdir, rounds))
        entries.append(measure(f"tiny, {LARGE_LAYERS['cpu']} layers of random weights", str(large), "cpu", workdir,
                               rounds))
        save()
    else:
        from quantship.quant.pipeline import QuantizeOptions, quantize

        small, bf16 = workdir / "coder-6.7b-4-layers", workdir / "coder-6.7b"
        if not (small / "config.json").exists():
            write_checkpoint("coder-6.7b", 4, small)
        entries.append(measure("coder-6.7b, 4 layers", str(small), "cuda", workdir, rounds))
        if not (bf16 / "config.json").exists():
            write_checkpoint("coder-6.7b", None, bf16)
        entries.append(measure("coder-6.7b bf16", str(bf16), "cuda", workdir, rounds))
        save()
        w4 = workdir / "coder-6.7b-w4a16"
        if not (w4 / "config.json").exists():
            quantize(bf16, w4, QuantizeOptions(scheme="W4A16", method="rtn", device="cuda", samples=4, seq_len=64),
                     progress=False)
        entries.append(measure("coder-6.7b W4A16", str(w4), "cuda", workdir, rounds))
        save()


def fit(small: dict, large: dict) -> dict:
    """Time to ready = fixed + bytes / rate through the two checkpoints' medians: the rate covers every
    phase that grows with the checkpoint (load, cache, warm-up), the fixed part the rest. The same
    line through load_weights alone is kept for reference."""
    def med(entry, key):
        return statistics.median(key(r) for r in entry["runs"])

    def line(key) -> tuple[float, float]:
        t_small, t_large = med(small, key), med(large, key)
        rate = (b_large - b_small) / max(t_large - t_small, 1e-9)
        return rate, max(0.0, t_small - b_small / rate)

    b_small, b_large = small["runs"][0]["checkpoint_bytes"], large["runs"][0]["checkpoint_bytes"]
    rate, fixed = line(lambda r: r["startup_to_ready_seconds"])
    load_rate, load_fixed = line(lambda r: r["phases"]["load_weights"])
    return {"load_bytes_per_second": rate, "fixed_seconds": fixed, "load_weights_bytes_per_second": load_rate,
            "load_weights_fixed_seconds": load_fixed, "from": [small["label"], large["label"]]}


def _median(runs: list[dict], key) -> float:
    return statistics.median(key(r) for r in runs)


def _fit_line(r: dict) -> str:
    f = r["fit"]
    return (f"{r['device']}: a line through {f['from'][0]} and {f['from'][1]}: time to ready = {f['fixed_seconds']:.1f} s "
            f"+ checkpoint bytes / {f['load_bytes_per_second'] / 1e6:.1f} MB/s (every phase that grows with the "
            f"checkpoint: loading, the cache, the warm-up's forward pass); load_weights alone = "
            f"{f['load_weights_fixed_seconds']:.1f} s + bytes / {f['load_weights_bytes_per_second'] / 1e6:.1f} MB/s."
            + (f" {r['note']}" if r.get("note") else ""))


def render(paths: list[str]) -> None:
    rows, results = [], []
    for p in paths:
        r = json.loads(Path(p).read_text())
        write_result(Path(p).stem, r)
        results.append(r)
        for e in r["entries"]:
            runs = e["runs"]
            rows.append([f"{e['label']}, {r['device']}", *(f"{_median(runs, lambda x, k=k: x['phases'].get(k, 0)):.2f}"
                                                         for k in PHASES),
                         f"{_median(runs, lambda x: x['startup_to_ready_seconds']):.2f} / "
                         f"{_median(runs, lambda x: x['outside_ready_s']):.2f}",
                         f"{_median(runs, lambda x: x['startup_to_first_token_seconds']):.2f} / "
                         f"{_median(runs, lambda x: x['outside_first_token_s']):.2f}",
                         f"{_median(runs, lambda x: x['load_bytes_per_s']) / 1e6:.0f}"])
    gpu = any(r["where"] == "gpu" for r in results)
    rounds = sorted({r["rounds"] for r in results})
    update_section("cold_start", "## Cold start of `quantship serve`\n\n"
        "`benchmarks/cold_start.py`: a fresh server process per round (median of "
        f"{' or '.join(map(str, rounds))}), its own phases from `quantship:startup_seconds`, seconds. \"ready\" and "
        "\"first token\" are the server's clock (from the kernel's process start time) / the benchmark's (from "
        "spawning the process to /ready answering, to the one-token response). Load rate = checkpoint bytes on "
        "disk / load_weights, warm page cache. The CPU rows ran on the shared 2-core host, whose load makes them "
        "noisy." + ("" if gpu else " No GPU row yet: the GPU command is in the script's docstring.") + "\n\n"
        + table(["model", *PHASES, "ready (server / outside)", "first token (server / outside)", "load MB/s"], rows)
        + "\n\n" + "\n\n".join(_fit_line(r) for r in results if r.get("fit"))
        + "\n\ndeploy/startup.yaml sizes the native engine's startupProbe from such lines (src/quantship/deploy/"
        "startup.yaml): on CPU it keeps the one measured on this host under a load average near 8 (slower than the "
        "line above), so that a busy node still starts within its probe.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--where", choices=["cpu", "gpu"], required=True)
    r.add_argument("--rounds", type=int, default=ROUNDS)
    r.add_argument("--workdir", default="/tmp/qs-cold-start")
    r.add_argument("--out", default="benchmarks/results")
    g = sub.add_parser("render")
    g.add_argument("paths", nargs="+")
    args = ap.parse_args()
    if args.cmd == "render":
        render(args.paths)
    else:
        work = Path(args.workdir)
        work.mkdir(parents=True, exist_ok=True)
        run(args.where, Path(args.out), work, args.rounds)


if __name__ == "__main__":
    main()
