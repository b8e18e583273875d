"""`quantship bench` end to end: check the input, build prompts, drive the load, write and judge the results.

Everything a user can get wrong is checked before the first request, so a typo costs a second, not
a sweep. Ctrl-C stops sending, cancels what is in flight and still writes what finished.
"""

from __future__ import annotations

import asyncio
import ipaddress
import signal
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from urllib.parse import urlsplit

from quantship import __version__
from quantship.bench.load import CAP_REQUESTS, PROFILES
from quantship.errors import QuantshipError
from quantship.files import check_output_location

DEFAULT_REQUESTS = 100
DEFAULT_CONCURRENCY = 32
# Hard caps: a mistyped extra zero should not become a day-long load on someone's server.
CAPS = {"requests": CAP_REQUESTS, "duration": 3600.0, "concurrency": 4096, "rate": 10_000.0, "steps": 20,
        "input_len": 131_072, "output_len": 32_768, "timeout": 3600.0, "burstiness": 100.0}


@dataclass
class BenchOptions:
    url: str
    model: str | None = None
    profile: str = "sweep"
    rates: list[float] = field(default_factory=list)
    concurrency: int | None = None
    burstiness: float = 1.0
    steps: int = 5
    requests: int | None = None
    duration: float | None = None
    input_len: int | None = None
    output_len: int = 128
    prompts: Path | None = None
    tokenizer: Path | None = None
    slo: str | None = None
    output: Path = Path("quantship-bench")
    baseline: Path | None = None
    tolerance: str = "5%"
    gate_file: Path | None = None
    timeout: float = 120.0
    allow_remote: bool = False
    details: bool = False
    seed: int = 0
    otlp_endpoint: str | None = None


def check_url(url: str, allow_remote: bool) -> str:
    """The server's base URL (no trailing /v1); only http(s), and only loopback unless allowed."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise QuantshipError(f"URL must look like http://127.0.0.1:8000, got {url!r}")
    if parts.username or parts.query or parts.fragment:
        raise QuantshipError(f"URL must be a plain server address without credentials, query or fragment: {url!r}")
    try:
        parts.port
    except ValueError:
        raise QuantshipError(f"URL has a bad port: {url!r}") from None
    host = parts.hostname
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback and not allow_remote:
        raise QuantshipError(f"refusing to load non-loopback host {host}; pass --allow-remote to benchmark a "
                             "server that is not on this machine")
    path = parts.path.rstrip("/")
    path = path[:-3] if path.endswith("/v1") else path
    return f"{parts.scheme}://{parts.netloc}{path}"


def validate(opts: BenchOptions) -> None:
    def bound(name: str, value, low_exclusive: float = 0):
        if value is not None and not (low_exclusive < value <= CAPS[name]):
            raise QuantshipError(f"--{name.replace('_', '-')} must be above {low_exclusive:g} "
                                 f"and at most {CAPS[name]:g}")

    if opts.profile not in PROFILES:
        raise QuantshipError(f"--profile must be one of {', '.join(PROFILES)}")
    if opts.requests is not None and opts.duration is not None:
        raise QuantshipError("give --requests or --duration, not both")
    for name in ("requests", "duration", "concurrency", "steps", "input_len", "output_len", "timeout", "burstiness"):
        bound(name, getattr(opts, name))
    for rate in opts.rates:
        bound("rate", rate)
    if len(opts.rates) > CAPS["steps"]:
        raise QuantshipError(f"at most {CAPS['steps']} rates")
    if opts.profile in ("constant", "poisson") and not opts.rates:
        raise QuantshipError(f"--profile {opts.profile} needs --rate R (requests/s; several make a ladder)")
    if opts.profile not in ("constant", "poisson") and opts.rates:
        raise QuantshipError("--rate applies to --profile constant or poisson (sweep finds its own rates)")
    if opts.prompts and opts.input_len:
        raise QuantshipError("give --input-len or --prompts, not both")
    if opts.otlp_endpoint is not None:
        from quantship.server.tracing import traces_url

        traces_url(opts.otlp_endpoint)
    check_output_location(Path(opts.output) / "bench.json", "output")  # before the load, not after it


async def _drive(target, opts: BenchOptions, progress):
    from quantship.bench.load import run_profile

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_interrupt():
        stop.set()
        loop.remove_signal_handler(signal.SIGINT)  # a second Ctrl-C ends at once, without writing

    try:
        loop.add_signal_handler(signal.SIGINT, on_interrupt)
        installed = True
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
        installed = False
    try:
        concurrency = opts.concurrency or (DEFAULT_CONCURRENCY if opts.profile in ("sweep", "concurrent") else None)
        results = await run_profile(target, opts.profile, opts.rates, concurrency, opts.burstiness, opts.steps,
                                    stop, progress)
    finally:
        if installed:
            loop.remove_signal_handler(signal.SIGINT)
    return results, stop.is_set()


def run_bench(opts: BenchOptions, console=None, err_console=None) -> int:
    """0 when done, 1 when the baseline gate failed, 130 after Ctrl-C (results written in every case)."""
    from rich.console import Console

    from quantship.bench import compare, console as view, prompts as prompt_source, stats
    from quantship.bench.client import completion_payload, first_model, probe_completion
    from quantship.bench.load import Target
    from quantship.bench.output import result_document, write_outputs
    from quantship.bench.plots import all_plots

    base = check_url(opts.url, opts.allow_remote)
    validate(opts)
    slo = stats.parse_slo(opts.slo)
    tolerance = compare.parse_tolerance(opts.tolerance)
    gates = compare.read_gate_file(opts.gate_file, tolerance) if opts.gate_file else compare.default_gates(tolerance)
    baseline = compare.read_result(opts.baseline) if opts.baseline else None
    planned = {"sweep": 1 + opts.steps, "constant": len(opts.rates), "poisson": len(opts.rates)}.get(opts.profile, 1)
    if baseline is not None and len(compare.steps_of(baseline)) != planned:
        raise QuantshipError(f"the baseline has {len(compare.steps_of(baseline))} step(s) and this run would have "
                             f"{planned}; compare runs of the same profile and rates", opts.baseline)
    if console is None:
        console = Console()
        if not console.is_terminal:  # a log or a CI job: keep the tables whole rather than 80 columns wide
            console.width = max(console.width, 150)
    err_console = err_console or Console(stderr=True)

    served = first_model(base)  # also proves the server answers before we build anything
    model = opts.model or served
    if not model:
        raise QuantshipError(f"{base}/v1/models lists no model; pass --model NAME")
    tokenizer = prompt_source.load_bench_tokenizer(opts.tokenizer)
    requests = opts.requests if opts.requests or opts.duration else DEFAULT_REQUESTS
    if opts.prompts:
        prompts = prompt_source.file_prompts(opts.prompts, tokenizer)
        source = str(opts.prompts)
    else:
        input_len = opts.input_len or 256
        prompts = prompt_source.synthetic_prompts(tokenizer, input_len, requests or prompt_source.MAX_DISTINCT_PROMPTS)
        source = f"bundled evaluation text, {input_len} tokens each"
    probe = asyncio.run(probe_completion(f"{base}/v1/completions",
                                         completion_payload(model, prompts[0].text, min(opts.output_len, 4)),
                                         min(opts.timeout, 60.0)))
    if not probe.ok:
        detail = f": {probe.detail}" if probe.detail else ""
        raise QuantshipError(f"a test request to {base}/v1/completions (model {model!r}) failed with "
                             f"{probe.error}{detail}")
    from quantship.bench.tracing import build_client_tracer

    target = Target(f"{base}/v1/completions", model, prompts, opts.output_len, opts.timeout, requests, opts.duration,
                    opts.seed, build_client_tracer(opts.otlp_endpoint))
    try:
        with view.LiveProgress(err_console) as progress:
            results, interrupted = asyncio.run(_drive(target, opts, progress))
    finally:
        if target.tracer is not None:
            target.tracer.shutdown()  # export the last batch of spans

    summaries = [stats.summarize(r, slo) for r in results]
    meta = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "tool": f"quantship {__version__}",
            "backend": "openai", "endpoint_type": "openai", "base_url": base, "endpoint": "/v1/completions",
            "model_id": model, "tokenizer_id": str(opts.tokenizer or "bundled tiny"), "prompt_source": source,
            "output_len": opts.output_len, "profile": opts.profile, "num_prompts": requests,
            "duration_limit_s": opts.duration, "seed": opts.seed, "interrupted": interrupted}
    doc = result_document(meta, summaries, [stats.details(r) for r in results] if opts.details else None)
    rows, gate_error = None, None
    if baseline is not None and summaries and not interrupted:
        try:  # a sweep cut short has fewer steps than planned: write the results anyway, then say so
            rows = compare.compare(baseline, doc, gates)
            doc["baseline_comparison"] = {"file": str(opts.baseline), "regressions": sum(r.regressed for r in rows),
                                          "rows": [asdict(r) for r in rows]}
        except QuantshipError as exc:
            gate_error = exc
    pngs = all_plots(results, summaries) if summaries else {}
    paths = write_outputs(opts.output, doc, pngs, rows) if summaries else []

    if summaries:
        console.print(view.steps_table(summaries, f"{model} at {base} ({opts.profile})", console.width))
    for line in view.failure_lines(summaries):
        console.print(f"failures {line}", highlight=False)
    if paths:
        console.print(f"wrote {', '.join(p.name for p in paths)} in {opts.output}", highlight=False)
    if interrupted:
        console.print("interrupted: the results above are what finished before Ctrl-C", highlight=False)
        return 130
    if not any(s["completed"] for s in summaries):
        reasons = "; ".join(view.failure_lines(summaries)) or "nothing was sent"
        raise QuantshipError(f"no request completed ({reasons}); details in {opts.output / 'bench.json'}")
    if gate_error is not None:
        raise gate_error
    if rows is not None:
        console.print(view.comparison_table(rows, str(opts.baseline)))
        regressed = sum(r.regressed for r in rows)
        console.print(f"baseline gate: {'PASS' if not regressed else f'{regressed} of {len(rows)} REGRESSED'}")
        return 1 if regressed else 0
    return 0
