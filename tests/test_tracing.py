"""OpenTelemetry request traces: the span tree in process (in-memory exporter), then a real server
and a real bench exporting OTLP/HTTP protobuf to a receiver this test runs."""

import asyncio
import concurrent.futures
import http.server
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from quantship.cli import main
from quantship.engine.async_engine import AsyncEngine
from quantship.engine.config import EngineConfig
from quantship.engine.engine import load_engine
from quantship.models.bundled import TINY_DIR
from quantship.server.app import create_app
from quantship.server.tracing import RequestTracer, make_provider, traces_url, tracing_requested

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
CHUNK = 16  # max_num_batched_tokens: a longer prompt is prefilled in several chunks


@pytest.fixture(scope="module")
def traced():
    exporter = InMemorySpanExporter()
    # No prefix caching, so every prompt token is computed and the chunks add up to the prompt.
    config = EngineConfig(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=CHUNK,
                          enable_prefix_caching=False)
    engine = AsyncEngine(load_engine(TINY_DIR, config=config), "tiny")
    engine.start()
    with TestClient(create_app(engine, tracer=RequestTracer(make_provider(None, "test", exporter)))) as client:
        yield client, exporter
    asyncio.run(engine.shutdown(drain=False, timeout=1))


def tree(exporter):
    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.kind is SpanKind.SERVER]
    assert len(roots) == 1, [s.name for s in spans]
    root = roots[0]
    children = [s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id]
    return root, children


def by_name(children, name):
    return [c for c in children if c.name == name]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_span_tree_matches_the_response(traced, stream):
    client, exporter = traced
    exporter.clear()
    body = {"prompt": "def fibonacci(n):\n    " * 4, "max_tokens": 7, "ignore_eos": True, "temperature": 0,
            "priority": 2, "stream": stream, "stream_options": {"include_usage": True} if stream else None}
    response = client.post("/v1/completions", json={k: v for k, v in body.items() if v is not None},
                           headers=TRACEPARENT)
    assert response.status_code == 200, response.text
    if stream:
        events = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        usage, answer_id = events[-1]["usage"], events[0]["id"]
    else:
        usage, answer_id = response.json()["usage"], response.json()["id"]
    root, children = tree(exporter)

    # The caller's trace is continued.
    assert format(root.context.trace_id, "032x") == TRACE_ID and format(root.parent.span_id, "016x") == PARENT_ID
    assert root.name == "POST /v1/completions" and root.attributes["http.response.status_code"] == 200
    a = root.attributes
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 7
    assert a["gen_ai.response.finish_reasons"] == ("length",) and a["gen_ai.response.id"] == answer_id
    assert a["quantship.priority"] == 2 and a["quantship.preemptions"] == 0

    assert sorted({c.name for c in children}) == ["decode", "detokenize", "prefill", "queue"]
    prefills = sorted(by_name(children, "prefill"), key=lambda s: s.start_time)
    assert sum(p.attributes["quantship.prefill.tokens"] for p in prefills) == usage["prompt_tokens"]
    assert len(prefills) == -(-usage["prompt_tokens"] // CHUNK) > 1
    assert [p.attributes["quantship.prefill.chunk"] for p in prefills] == list(range(len(prefills)))
    (queue,), (decode,), (detok,) = (by_name(children, n) for n in ("queue", "decode", "detokenize"))
    assert decode.attributes["quantship.decode.tokens"] == usage["completion_tokens"] - 1

    # Timings: children inside the request, in the engine's order, and equal to the latency attributes.
    for child in children:
        assert root.start_time <= child.start_time <= child.end_time <= root.end_time, child.name
    assert queue.end_time <= prefills[0].start_time
    assert all(x.end_time <= y.start_time for x, y in zip(prefills, prefills[1:]))
    assert prefills[-1].end_time == decode.start_time  # the last chunk's step samples the first token
    ns = 1e9
    assert (queue.end_time - queue.start_time) / ns == pytest.approx(a["gen_ai.latency.time_in_queue"], abs=1e-6)
    assert (decode.end_time - queue.start_time) / ns == pytest.approx(a["gen_ai.latency.e2e"], abs=1e-6)
    assert (decode.start_time - queue.start_time) / ns == pytest.approx(a["gen_ai.latency.time_to_first_token"],
                                                                         abs=1e-6)
    busy = detok.attributes["quantship.detokenize.busy_s"]
    assert 0 < busy <= (detok.end_time - detok.start_time) / ns + 1e-6


def test_refused_request_is_traced_without_engine_spans(traced):
    client, exporter = traced
    exporter.clear()
    response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 10_000})
    assert response.status_code == 400
    root, children = tree(exporter)
    assert root.attributes["http.response.status_code"] == 400 and children == []
    assert root.parent is None  # no traceparent: a new trace


def test_malformed_traceparent_starts_a_new_trace(traced):
    client, exporter = traced
    exporter.clear()
    response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2},
                           headers={"traceparent": "00-zz-yy-01"})
    assert response.status_code == 200
    root, children = tree(exporter)
    assert root.parent is None and {c.name for c in children} >= {"queue", "prefill", "decode"}


def test_tracing_off_imports_no_opentelemetry_sdk():
    # FastAPI itself imports the opentelemetry *API* when it is installed; the SDK (spans, exporters)
    # is what tracing adds, and it must stay out of an untraced server.
    code = ("import sys, asyncio\n"
            "from fastapi.testclient import TestClient\n"
            "from quantship.engine.async_engine import AsyncEngine\n"
            "from quantship.engine.config import EngineConfig\n"
            "from quantship.engine.engine import load_engine\n"
            "from quantship.models.bundled import TINY_DIR\n"
            "from quantship.server.app import create_app\n"
            "from quantship.server.tracing import build_request_tracer\n"
            "e = AsyncEngine(load_engine(TINY_DIR, config=EngineConfig(max_model_len=64)), 't'); e.start()\n"
            "with TestClient(create_app(e, tracer=build_request_tracer(None))) as c:\n"
            "    assert c.post('/v1/completions', json={'prompt': 'a', 'max_tokens': 2}).status_code == 200\n"
            "asyncio.run(e.shutdown(drain=False, timeout=1))\n"
            "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter'))))\n")
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}  # no OTEL_* variables
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_environment_switches(monkeypatch):
    for name in ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    assert not tracing_requested(None) and tracing_requested("http://127.0.0.1:4318")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    assert tracing_requested(None)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert not tracing_requested("http://127.0.0.1:4318")
    assert traces_url("http://127.0.0.1:4318/") == "http://127.0.0.1:4318/v1/traces"
    assert traces_url("http://c:4318/v1/traces") == "http://c:4318/v1/traces"


@pytest.mark.parametrize("argv", [["serve", "tiny", "--otlp-endpoint", "127.0.0.1:4318"],
                                  ["bench", "http://127.0.0.1:9", "--otlp-endpoint", "ftp://x"]])
def test_bad_endpoint_is_one_line(argv, capsys):
    assert main(argv) != 0
    err = capsys.readouterr().err.strip()
    assert "--otlp-endpoint must be an http(s) URL" in err and "Traceback" not in err and len(err.splitlines()) == 1


# --- a real server and a real bench, exporting to a real OTLP/HTTP receiver ---------------------------

class Receiver(http.server.ThreadingHTTPServer):
    """A minimal OTLP/HTTP collector: POST /v1/traces with an ExportTraceServiceRequest protobuf."""

    def __init__(self):
        self.spans, self.content_types = [], set()
        super().__init__(("127.0.0.1", 0), self.Handler)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            self.server.content_types.add((self.path, self.headers["Content-Type"]))
            request = ExportTraceServiceRequest.FromString(body)
            for resource_spans in request.resource_spans:
                service = next(a.value.string_value for a in resource_spans.resource.attributes
                               if a.key == "service.name")
                for scope_spans in resource_spans.scope_spans:
                    self.server.spans += [(service, s) for s in scope_spans.spans]
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_and_bench_share_traces_over_otlp_http(tmp_path):
    receiver = Receiver()
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{receiver.server_address[1]}"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "wb")
    server = subprocess.Popen([sys.executable, "-m", "quantship.cli", "serve", "tiny", "--port", str(port),
                               "--max-model-len", "256", "--otlp-endpoint", endpoint], stdout=log,
                              stderr=subprocess.STDOUT, env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert main(["bench", url, "--profile", "synchronous", "--requests", "3", "--input-len", "24",
                     "--output-len", "5", "-o", str(tmp_path / "bench"), "--otlp-endpoint", endpoint]) == 0
        server.send_signal(signal.SIGTERM)  # drains, then flushes the last batch of spans
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            server.kill()
        log.close()
        receiver.shutdown()
    assert receiver.content_types == {("/v1/traces", "application/x-protobuf")}
    client = [s for service, s in receiver.spans if service == "quantship-bench"]
    served = [s for service, s in receiver.spans if service == "quantship"]
    assert len(client) == 3
    for span in client:
        server_spans = [s for s in served if s.parent_span_id == span.span_id]
        assert len(server_spans) == 1, "each bench request continues into one server request span"
        root = server_spans[0]
        assert root.trace_id == span.trace_id and root.name == "POST /v1/completions"
        attributes = {a.key: a.value for a in root.attributes}
        assert attributes["gen_ai.usage.output_tokens"].int_value == 5
        children = [s for s in served if s.parent_span_id == root.span_id]
        assert {c.name for c in children} == {"queue", "prefill", "decode", "detokenize"}
        assert all(c.trace_id == span.trace_id for c in children)
        assert span.start_time_unix_nano <= root.start_time_unix_nano <= root.end_time_unix_nano \
            <= span.end_time_unix_nano + 5_000_000  # same machine, same clock; the client closes last


def test_preempted_request_reports_its_preemptions_and_recompute():
    """Too few KV blocks for two requests: the later one is preempted, and its trace says so."""
    exporter = InMemorySpanExporter()
    config = EngineConfig(max_model_len=256, max_num_seqs=2, block_size=16, num_blocks=5,
                          enable_prefix_caching=False)
    engine = AsyncEngine(load_engine(TINY_DIR, config=config), "tiny")
    engine.start()
    try:
        with TestClient(create_app(engine, tracer=RequestTracer(make_provider(None, "test", exporter)))) as client:
            def ask(_):
                body = {"prompt": "def fibonacci(n):", "max_tokens": 40, "ignore_eos": True, "temperature": 0}
                return client.post("/v1/completions", json=body)

            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                answers = list(pool.map(ask, range(2)))
    finally:
        asyncio.run(engine.shutdown(drain=False, timeout=1))
    assert [a.status_code for a in answers] == [200, 200]
    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.kind is SpanKind.SERVER]
    preempted = [r for r in roots if r.attributes["quantship.preemptions"] > 0]
    assert len(roots) == 2 and preempted, "5 blocks cannot hold two 50-token sequences"
    root = preempted[0]
    children = [s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id]
    (decode,) = by_name(children, "decode")
    recomputed = [p for p in by_name(children, "prefill") if p.start_time > decode.start_time]
    assert len(recomputed) >= root.attributes["quantship.preemptions"]  # each preemption recomputes its tokens
    assert root.attributes["gen_ai.usage.output_tokens"] == 40
