"""`quantship demo`: every stage on the bundled model, offline, on CPU, printed as each command prints it.

The commands run through `run` (the command line's own entry point, handed in by cli.py), so what the
demo shows is what a user typing them sees; quantization runs here to tabulate the four checkpoints.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from quantship.errors import QuantshipError
from quantship.files import write_atomic

RUNS = (("W4A16", "rtn"), ("W4A16", "gptq"), ("W4A16", "awq"), ("W8A16", "rtn"))
SERVED_NAME = "tiny-w4a16"
FIDELITY_JSON = "fidelity.json"  # the quantize table's rows, in the work directory


def run_demo(workdir: Path | None, run: Callable[[list[str]], int]) -> int:
    """The demo; `run(argv)` runs one command line and returns its exit code (a failing one ends the demo
    with its code: it has printed its error already)."""
    from rich.console import Console

    console = Console()
    shown = [("quantship info tiny", ["info", "tiny"])]
    for prompt in ("def fibonacci(n):", "ROMEO:"):
        shown.append((f"quantship generate tiny --prompt {prompt!r} --max-tokens 48",
                      ["generate", "tiny", "--prompt", prompt, "--max-tokens", "48", "--device", "cpu"]))
    for title, argv in shown:
        console.rule(f"[bold]{title}")
        code = run(argv)
        if code:
            return code
    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="quantship-demo-"))
    console.print(_quantize_table(console, work))
    console.print(f"checkpoints in {work} (the table as JSON: {FIDELITY_JSON}); llama.cpp's scale on Llama-3-8B: "
                  "q8_0 KL 0.0014, q4_K_M 0.028, q4_0 0.072")
    gptq = work / "tiny-w4a16-gptq"
    report = work / "report-w4a16-gptq"
    console.rule(f"[bold]quantship verify tiny {gptq} --report {report} --gate default")
    code = run(["verify", "tiny", str(gptq), "--report", str(report), "--ctx", "1024", "--max-tokens", "8192",
                "--gate", "default", "--device", "cpu"])
    if code not in (0, 1):  # 1 is a failed gate, which the demo reports rather than stops on
        return code
    console.print(f"open {report / 'report.html'} in a browser; gate verdict: {'PASS' if code == 0 else 'FAIL'}")
    serve_and_ask(console, gptq)
    return 0


def _quantize_table(console, work: Path):
    from rich.table import Table

    from quantship.progress import layer_bar
    from quantship.quant.pipeline import QuantizeOptions, quantize
    from quantship.verify.compare import quick_fidelity

    table = Table(title="W4A16 g128 and W8A16 on the bundled model, held-out text (8K tokens)")
    for column in ("checkpoint", "KL mean", "top-1 agreement", "ppl base", "ppl quant", "seconds"):
        table.add_column(column, justify="right" if column != "checkpoint" else "left")
    rows = []
    for scheme, method in RUNS:
        out = work / f"tiny-{scheme.lower()}-{method}"
        console.rule(f"[bold]quantship quantize tiny -o {out} --scheme {scheme} --method {method}")
        bar, step = layer_bar()
        with bar:
            recipe = quantize("tiny", out, QuantizeOptions(scheme=scheme, method=method, samples=64, seq_len=256,
                                                           overwrite=True), progress=step)
        r = quick_fidelity("tiny", out, max_tokens=8192)
        table.add_row(out.name, f"{r['kl_mean']:.4f}", f"{r['top1_agreement']:.1%}", f"{r['ppl_base']:.2f}",
                      f"{r['ppl_quant']:.2f}", f"{recipe['seconds']:.0f}")
        rows.append({"checkpoint": out.name, "scheme": scheme, "method": method, **r, "seconds": recipe["seconds"]})
    # The table's figures for scripts (and the test suite, which reads them rather than quantize again).
    write_atomic(work / FIDELITY_JSON, json.dumps(rows, indent=2) + "\n", "demo's fidelity table")
    return table


def serve_and_ask(console, model_dir: Path) -> None:
    """Start a real server process on the quantized model, ask it one chat question, show its metrics."""
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    console.rule(f"[bold]quantship serve {model_dir} --port {port}")
    server = subprocess.Popen([sys.executable, "-m", "quantship.cli", "serve", str(model_dir), "--port", str(port),
                               "--served-model-name", SERVED_NAME])
    try:
        _wait_ready(server, url)
        # The bundled model is a 19M base model (code, docs, Shakespeare), not chat-tuned: a code
        # opening is what it answers best, through the chat template like any client would send it.
        question = "def fibonacci(n):"
        body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": question}], "max_tokens": 64,
                "temperature": 0}
        console.print(f"POST {url}/v1/chat/completions  (user: {question!r}; a 19M base model, not chat-tuned)")
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
        console.print(f"assistant: {answer['choices'][0]['message']['content']!r}")
        console.print(f"usage: {answer['usage']}")
        wanted = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:kv_cache_usage_perc",
                  "vllm:time_to_first_token_seconds_sum", "vllm:e2e_request_latency_seconds_sum")
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            if line.startswith(wanted):
                console.print(line, soft_wrap=True)
    finally:
        server.terminate()  # SIGTERM: the server drains and exits
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def _wait_ready(server: subprocess.Popen, url: str, timeout_s: float = 180) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise QuantshipError("the demo server did not become ready")
        time.sleep(0.5)
