"""Prometheus metrics under vLLM's names, so dashboards, prometheus-adapter rules and KEDA triggers
written for vLLM work unchanged against quantship.

Gauges and counters of engine state are read from `AsyncEngine.stats()` at scrape time (a custom
collector: nothing to keep in sync); latency and size histograms are observed when a request
finishes. Everything lives in a registry of its own, so two apps in one process never collide.

Besides vLLM's names, two counters of HTTP answers feed error-rate gates:
- `http_requests_total{handler, method, status}`: status grouped as "2xx", "4xx", "5xx", the same
  series vLLM exposes through prometheus-fastapi-instrumentator, so one canary rule fits both engines;
- `quantship:http_responses_total{model_name, handler, code}`: the exact code (429 apart from 400).
Error rate of a canary: sum(rate(http_requests_total{status="5xx"}[5m])) / sum(rate(http_requests_total[5m])).
Only /v1/* answers are counted; 499 means the client left before the answer.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from quantship.engine.sequence import RequestMetrics

# Bucket edges chosen to cover a CPU tiny model (milliseconds) up to a large model under load (minutes).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                         10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
V1_HANDLERS = ("/v1/completions", "/v1/chat/completions", "/v1/models")


def one_two_five(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to limit: token-count buckets that reach the context length."""
    edges, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return edges
            edges.append(m * scale)
        scale *= 10


class EngineStateCollector(Collector):
    """vLLM's scheduler and cache series, read from the engine when Prometheus scrapes."""

    def __init__(self, async_engine, model_name: str, prefix_caching: bool):
        self.engine, self.model_name, self.prefix_caching = async_engine, model_name, prefix_caching

    def collect(self):
        s = self.engine.stats()
        label = [self.model_name]

        def family(cls, name, doc, value):
            metric = cls(name, doc, labels=["model_name"])
            metric.add_metric(label, value)
            return metric

        yield family(GaugeMetricFamily, "vllm:num_requests_running", "Requests in the running batch.", s.num_running)
        yield family(GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield family(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.",
                     s.kv_cache_usage)
        # CounterMetricFamily appends _total itself: these come out as vllm:prompt_tokens_total etc.
        yield family(CounterMetricFamily, "vllm:prompt_tokens", "Prompt tokens processed.", s.prompt_tokens)
        yield family(CounterMetricFamily, "vllm:generation_tokens", "Generated tokens.", s.generation_tokens)
        yield family(CounterMetricFamily, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                     s.prefix_cache_queries)
        yield family(CounterMetricFamily, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                     s.prefix_cache_hits)
        yield family(CounterMetricFamily, "vllm:num_preemptions", "Preemptions (recomputed sequences).",
                     s.num_preemptions)
        yield family(GaugeMetricFamily, "quantship:kv_cache_bytes_per_token", "KV-cache bytes per token.",
                     s.kv_bytes_per_token)
        info = GaugeMetricFamily("vllm:cache_config_info", "KV-cache configuration.",
                                 labels=["block_size", "num_gpu_blocks", "enable_prefix_caching"])
        info.add_metric([str(s.block_size), str(s.num_blocks), str(self.prefix_caching)], 1)
        yield info
        experts = self.engine.expert_tokens()
        if experts is not None:
            routed = CounterMetricFamily("quantship:moe_expert_tokens", "Tokens routed to each expert of each MoE "
                                         "layer (serve --expert-stats).", labels=["model_name", "layer", "expert"])
            for layer, counts in experts.items():
                for expert, count in enumerate(counts):
                    routed.add_metric([self.model_name, str(layer), str(expert)], count)
            yield routed


class StartupCollector(Collector):
    """Cold start (server/startup.py): phase durations, time to ready, time to the first token, and the
    checkpoint's size, so a dashboard can divide it by load_weights for the load rate."""

    def __init__(self, clock, engine, model_name: str, checkpoint_bytes: int):
        self.clock, self.engine, self.model_name, self.checkpoint_bytes = clock, engine, model_name, checkpoint_bytes

    def collect(self):
        phases = GaugeMetricFamily("quantship:startup_seconds", "Cold start, by phase (they add up to the time to "
                                   "ready).", labels=["model_name", "phase"])
        for phase, seconds in self.clock.phases.items():
            phases.add_metric([self.model_name, phase], seconds)
        yield phases
        for name, doc, value in (
                ("quantship:startup_to_ready_seconds", "Process start to ready.", self.clock.since_start(self.clock.ready_at)),
                ("quantship:startup_to_first_token_seconds", "Process start to the first generated token.",
                 self.clock.since_start(self.engine.first_token_at)),
                ("quantship:checkpoint_bytes", "Size of the served checkpoint on disk.", self.checkpoint_bytes)):
            if value is not None:
                metric = GaugeMetricFamily(name, doc, labels=["model_name"])
                metric.add_metric([self.model_name], value)
                yield metric


class ServerMetrics:
    def __init__(self, async_engine, model_name: str, max_model_len: int, prefix_caching: bool = True,
                 startup_clock=None, checkpoint_bytes: int = 0):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(EngineStateCollector(async_engine, model_name, prefix_caching))
        if startup_clock is not None:
            self.registry.register(StartupCollector(startup_clock, async_engine.engine, model_name, checkpoint_bytes))
        r, names = self.registry, ["model_name"]

        def histogram(name: str, doc: str, buckets):
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(model_name)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between consecutive tokens.",
                             TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Mean time per output token after the first.",
                              TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds", "Time spent waiting.", REQUEST_LATENCY_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds", "Time spent running.",
                                   REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds", "First scheduled to first token.",
                                 REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds", "First token to finish.", REQUEST_LATENCY_BUCKETS)
        size_buckets = one_two_five(max_model_len)
        self.prompt_len = histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", size_buckets)
        self.output_len = histogram("vllm:request_generation_tokens", "Generated tokens per request.", size_buckets)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               names + ["finished_reason"], registry=r)
        self.http = Counter("http_requests", "HTTP answers of /v1/*, status grouped.", ["handler", "method", "status"],
                            registry=r)
        self.http_codes = Counter("quantship:http_responses", "HTTP answers of /v1/* by exact status code.",
                                  names + ["handler", "code"], registry=r)

    def observe(self, m: RequestMetrics) -> None:
        """Listener for finished requests (called on the engine thread; prometheus-client is thread-safe)."""
        self.success.labels(self.model_name, m.finish_reason or "unknown").inc()
        for hist, value in ((self.ttft, m.ttft), (self.e2e, m.e2e), (self.queue, m.queue_time)):
            if value is not None:
                hist.observe(value)
        for gap in m.inter_token_latencies:
            self.itl.observe(gap)
        if m.first_token is not None and m.finished is not None and m.generation_tokens > 1:
            self.tpot.observe((m.finished - m.first_token) / (m.generation_tokens - 1))
        if m.first_scheduled is not None and m.finished is not None:
            self.inference.observe(m.finished - m.first_scheduled)
            if m.first_token is not None:
                self.prefill.observe(m.first_token - m.first_scheduled)
                self.decode.observe(m.finished - m.first_token)
        self.prompt_len.observe(m.prompt_tokens)
        self.output_len.observe(m.generation_tokens)

    def count_response(self, path: str, method: str, status: int) -> None:
        handler = path if path in V1_HANDLERS else "other"  # bounded label values whatever clients send
        self.http.labels(handler, method, f"{status // 100}xx").inc()
        self.http_codes.labels(self.model_name, handler, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
