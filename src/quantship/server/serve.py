"""`quantship serve`: load the model, start the engine thread, run uvicorn, drain on SIGTERM.

The port is bound before the model loads, so a taken port fails in a second, not after the load.
On SIGTERM or SIGINT the server stops taking requests (503, and /ready turns 503 so a load
balancer stops routing), lets every in-flight request finish, then exits 0. A second signal stops
the engine at once; every unfinished request is still answered properly (a 503 JSON body, or an
error event closing its stream) before the process exits. A third one exits without waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import socket
from dataclasses import dataclass
from pathlib import Path

from quantship.errors import QuantshipError

log = logging.getLogger("quantship.server")


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    engine: str = "native"  # or "vllm"
    device: str | None = None  # default: cuda when available
    served_model_name: str | None = None
    api_key: str | None = None
    api_key_file: Path | None = None  # keeps the key out of the process list, like $QUANTSHIP_API_KEY
    max_queue: int | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    block_size: int | None = None
    kv_cache_fraction: float | None = None  # share of memory free after the weights for the KV cache (0.85)
    prefix_caching: bool = True
    drain_timeout_s: float = 120.0
    inject_latency_ms: float = 0.0  # canary drills: a deliberately worse server
    inject_error_rate: float = 0.0
    request_timeout_s: float | None = None
    otlp_endpoint: str | None = None  # OpenTelemetry traces over OTLP/HTTP (or the OTEL_* variables)
    expert_stats: bool = False  # count tokens per routed expert (metric quantship:moe_expert_tokens_total)


def default_model_name(path: Path) -> str:
    return path.resolve().name or "model"


def _bind(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise QuantshipError(f"--port must be in 0..65535, got {port}")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        raise QuantshipError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def _check(opts: ServeOptions) -> None:
    for name in ("max_queue", "max_num_seqs", "max_model_len", "block_size"):
        value = getattr(opts, name)
        if value is not None and value < 1:
            raise QuantshipError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if opts.request_timeout_s is not None and opts.request_timeout_s <= 0:
        raise QuantshipError(f"--request-timeout must be positive, got {opts.request_timeout_s}")
    if not 0 <= opts.inject_latency_ms < math.inf or not 0 <= opts.inject_error_rate <= 1:
        raise QuantshipError("--inject-latency-ms must be >= 0 and --inject-error-rate in [0, 1]")
    if opts.kv_cache_fraction is not None and not 0 < opts.kv_cache_fraction <= 1:
        raise QuantshipError(f"--kv-cache-fraction must be in (0, 1], got {opts.kv_cache_fraction}")
    if opts.kv_cache_fraction is not None and opts.engine == "vllm":
        raise QuantshipError("--kv-cache-fraction is the native engine's; vLLM takes --gpu-memory-utilization")
    if opts.api_key_file is not None:
        opts.api_key = _read_api_key(Path(opts.api_key_file), opts.api_key)
    if opts.otlp_endpoint is not None:
        from quantship.server.tracing import traces_url

        traces_url(opts.otlp_endpoint)  # a malformed URL fails now, not at the first export
    if opts.expert_stats and opts.engine == "vllm":
        raise QuantshipError("--expert-stats counts in quantship's own engine; with --engine vllm it has no effect")


def _read_api_key(path: Path, given: str | None) -> str:
    if given is not None:
        raise QuantshipError("give the API key once: --api-key-file, or --api-key / $QUANTSHIP_API_KEY")
    try:
        key = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise QuantshipError(f"cannot read the API key ({getattr(exc, 'strerror', None) or exc})", path) from None
    if not key or any(c.isspace() for c in key):
        raise QuantshipError("the API key file must hold one key on one line", path)
    return key


def _check_context(path: Path, max_model_len: int | None) -> None:
    """A longer context than the model was trained for is refused, not clamped behind the user's back."""
    from quantship.models.config import load_config

    limit = load_config(path).max_position_embeddings
    if max_model_len is not None and max_model_len > limit:
        raise QuantshipError(f"--max-model-len {max_model_len} exceeds the model's context of {limit} tokens "
                             f"(max_position_embeddings in config.json)", path)


def serve(model: str | Path | None, opts: ServeOptions) -> int:
    from quantship.models.bundled import resolve_model

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    _check(opts)
    path = resolve_model(model)
    _check_context(path, opts.max_model_len)
    name = opts.served_model_name or default_model_name(path)
    if opts.engine == "vllm":
        from quantship.server.vllm import exec_vllm, find_vllm, vllm_command

        executable = find_vllm()
        if executable is None:
            raise QuantshipError("--engine vllm needs vLLM, which is not installed (no `vllm` executable on PATH); "
                                 "pip install vllm on a GPU machine, or use --engine native")
        exec_vllm(vllm_command(path, name, opts.host, opts.port, executable, opts.max_model_len, opts.api_key,
                               opts.max_num_seqs, opts.block_size, opts.prefix_caching, opts.max_queue))
    from quantship.server.startup import StartupClock

    clock = StartupClock()
    sock = _bind(opts.host, opts.port)
    try:
        async_engine, app = _build(path, name, opts, clock)
        host, port = sock.getsockname()[:2]
        url_host = f"[{host}]" if ":" in host else host
        log.info("serving %s at http://%s:%d/v1 (/metrics, /health, /ready)%s", name, url_host, port,
                 "; API key required on /v1/*" if opts.api_key else "")
        try:
            asyncio.run(_run(app, async_engine, sock, opts.drain_timeout_s, clock))
        finally:
            if app.state.tracer is not None:
                app.state.tracer.shutdown()  # export the last batch of spans
    finally:
        sock.close()
    return 0


def _build(path: Path, name: str, opts: ServeOptions, clock):
    import torch

    from quantship.engine import memory as memory_setup
    from quantship.engine.async_engine import AsyncEngine
    from quantship.engine.config import EngineConfig
    from quantship.engine.engine import load_engine
    from quantship.engine.memory import CacheTooSmall
    from quantship.models.quantized import weight_memory
    from quantship.server.app import create_app
    from quantship.server.tracing import build_request_tracer

    config = EngineConfig(enable_prefix_caching=opts.prefix_caching, expert_stats=opts.expert_stats)
    for option, field_name in (("max_queue", "max_waiting"), ("max_num_seqs", "max_num_seqs"),
                               ("max_model_len", "max_model_len"), ("block_size", "block_size"),
                               ("kv_cache_fraction", "kv_cache_fraction")):
        if getattr(opts, option) is not None:
            setattr(config, field_name, getattr(opts, option))
    device = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
    log.info("loading %s on %s", path, device)
    try:
        engine = load_engine(path, device, config=config, phase=clock.phase)
    except CacheTooSmall as exc:
        raise QuantshipError(f"no room for a KV cache on {device}: {exc}") from None
    # Running out of memory here (graphs, warm-up) is raised: the CLI says what to lower (cli.LESS_MEMORY).
    with clock.phase("capture_cuda_graphs"):
        graphs = engine.runner.capture_graphs(config.max_num_seqs)
    with clock.phase("warmup"):
        engine.warm_up()
    memory = weight_memory(engine.model)
    log.info("weights: %.1f MiB on %s%s", memory["weight_bytes"] / 2**20, device,
             f", of which {memory['packed_linears']} packed int Linears {memory['packed_linear_bytes'] / 2**20:.1f} MiB"
             if memory["packed_linears"] else "")
    if device.startswith("cuda"):
        log.info("CUDA allocator: %s", memory_setup.allocator_setting())
    s = engine.stats()
    log.info("KV cache: %d blocks of %d tokens (%d tokens), %d bytes per token, %.1f MiB; context %d tokens, "
             "batch up to %d sequences, queue bound %d, prefix caching %s", s.num_blocks, s.block_size,
             s.num_blocks * s.block_size, s.kv_bytes_per_token,
             s.num_blocks * s.block_size * s.kv_bytes_per_token / 2**20, engine.max_model_len,
             config.max_num_seqs, config.max_waiting, "on" if config.enable_prefix_caching else "off")
    checkpoint_bytes = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    load_s = clock.phases.get("load_weights", 0.0)
    log.info("start-up: weights %.2fs (%.0f MB/s of checkpoint), cache %.2fs, %s, warm-up %.2fs",
             load_s, checkpoint_bytes / max(load_s, 1e-9) / 1e6, clock.phases.get("build_cache", 0.0),
             f"{graphs} CUDA graphs {clock.phases['capture_cuda_graphs']:.2f}s" if graphs else "no CUDA graphs",
             clock.phases.get("warmup", 0.0))
    async_engine = AsyncEngine(engine, name)
    first_token_logged = []

    def log_first_token(_metrics) -> None:  # engine thread; once
        if not first_token_logged and engine.first_token_at is not None:
            first_token_logged.append(True)
            log.info("cold start: first token %.2fs after the process started", clock.since_start(engine.first_token_at))

    async_engine.add_listener(log_first_token)
    faults = None
    if opts.inject_latency_ms or opts.inject_error_rate:
        faults = {"latency_s": opts.inject_latency_ms / 1000, "error_rate": opts.inject_error_rate}
        log.warning("fault injection on: +%.0f ms per request, %.1f%% answered 500", opts.inject_latency_ms,
                    100 * opts.inject_error_rate)
    tracer = build_request_tracer(opts.otlp_endpoint)
    if tracer is not None:
        log.info("tracing: OpenTelemetry spans to %s", opts.otlp_endpoint or "the OTEL_EXPORTER_OTLP_* endpoint")
    return async_engine, create_app(async_engine, api_key=opts.api_key, faults=faults,
                                    request_timeout_s=opts.request_timeout_s, tracer=tracer, startup_clock=clock,
                                    checkpoint_bytes=checkpoint_bytes)


async def _run(app, async_engine, sock: socket.socket, drain_timeout_s: float, clock=None) -> None:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def capture_signals(self):  # our handlers below drain first; uvicorn's would stop at once
            return contextlib.nullcontext()

    server = DrainingServer(uvicorn.Config(app, lifespan="off", log_level="info", timeout_graceful_shutdown=30))
    async_engine.start()
    loop = asyncio.get_running_loop()
    stages: list[asyncio.Task] = []  # the drain, then the stop

    async def drain(sig_name: str) -> None:
        log.info("%s: refusing new requests, draining in-flight ones (up to %.0fs)", sig_name, drain_timeout_s)
        await async_engine.shutdown(drain=True, timeout=drain_timeout_s)
        log.info("drained; stopping")
        server.should_exit = True

    async def stop_now() -> None:
        # The engine stops first, so each in-flight handler gets its final output and answers its
        # client (503 or a closed stream) before uvicorn closes the connections.
        await async_engine.shutdown(drain=False, timeout=0)
        server.should_exit = True

    def on_signal(sig: signal.Signals) -> None:
        if not stages:
            stages.append(loop.create_task(drain(sig.name)))
        elif len(stages) == 1:
            log.warning("%s again: stopping now; unfinished requests are answered 503", sig.name)
            stages[0].cancel()
            stages.append(loop.create_task(stop_now()))
        else:
            log.warning("%s a third time: exiting without waiting", sig.name)
            server.should_exit = server.force_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)

    async def note_ready() -> None:
        while not server.started and not server.should_exit:
            await asyncio.sleep(0.005)
        if server.started and clock is not None:
            clock.mark_ready()
            log.info("cold start: %s", clock.summary())

    ready = loop.create_task(note_ready())
    try:
        await server.serve(sockets=[sock])
    finally:
        ready.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        # Always join the engine thread: exiting while it is inside torch aborts the process.
        await async_engine.shutdown(drain=False, timeout=0)
