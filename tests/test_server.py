"""quantship serve: the OpenAI API in process, then real server processes under load, faults and SIGTERM."""

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from quantship.cli import main
from quantship.engine import async_engine as async_engine_module
from quantship.engine.async_engine import AsyncEngine, QueueFull
from quantship.engine.config import EngineConfig
from quantship.engine.engine import RequestOutput, load_engine
from quantship.errors import QuantshipError
from quantship.models.bundled import TINY_DIR
from quantship.quant.pipeline import QuantizeOptions, quantize
from quantship.server import vllm as launcher
from quantship.server.app import create_app

GREEDY = {"temperature": 0}
PROMPT = "def fibonacci(n):"
JSON_TYPE = {"content-type": "application/json"}
TOKEN_COUNTERS = (("vllm:prompt_tokens_total", "prompt_tokens"), ("vllm:generation_tokens_total", "completion_tokens"))


# --- helpers ----------------------------------------------------------------------------------------

def metric(text: str, name: str, default: float | None = None, **labels) -> float:
    """Sum of the samples of one series family in a Prometheus exposition, filtered by labels."""
    total, found = 0.0, False
    for line in text.splitlines():
        m = re.match(r"^([^\s{]+)(?:\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total, found = total + float(m.group(3)), True
    assert found or default is not None, f"{name} {labels} not in /metrics"
    return total


def sse_events(text: str) -> list:
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", text[-500:]
    return [json.loads(e) for e in events[:-1]]


def assert_openai_error(response, status: int):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


# --- in process ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def async_engine():
    engine = AsyncEngine(load_engine(TINY_DIR, config=EngineConfig(max_model_len=512, max_num_seqs=8)), "tiny")
    engine.start()
    yield engine
    asyncio.run(engine.shutdown(drain=False, timeout=1))


@pytest.fixture(scope="module")
def client(async_engine):
    with TestClient(create_app(async_engine)) as c:
        yield c


def test_health_ready_models(client):
    assert client.get("/health").status_code == 200
    assert client.get("/ready").json()["status"] == "ready"
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    assert models["data"][0]["max_model_len"] == 512


def test_completion_json_stream_and_token_prompt_agree(client, async_engine):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, **GREEDY}
    first = client.post("/v1/completions", json=body).json()
    assert first["object"] == "text_completion" and first["id"].startswith("cmpl-")
    choice = first["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["text"]) > 5
    prompt_ids = async_engine.engine.tokenizer(PROMPT)["input_ids"]
    n = len(prompt_ids)
    assert first["usage"] == {"prompt_tokens": n, "completion_tokens": 12, "total_tokens": n + 12}
    by_ids = client.post("/v1/completions", json={**body, "prompt": prompt_ids}).json()
    assert by_ids["choices"][0]["text"] == choice["text"]
    stream = client.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert stream.headers["content-type"].startswith("text/event-stream")
    chunks = sse_events(stream.text)
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == choice["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == first["usage"]
    assert all(c["usage"] is None for c in chunks[:-1])
    plain = sse_events(client.post("/v1/completions", json={**body, "stream": True}).text)
    assert all("usage" not in c for c in plain)


def test_stats_are_a_snapshot_the_stepping_thread_took(client, async_engine, monkeypatch):
    """/metrics and stats() read what the engine thread published between steps, never the engine's live
    counters from another thread; a finished request is counted by the time its answer arrives."""
    live = async_engine.engine.stats

    def stepping_thread_only():
        assert threading.current_thread().name == "quantship-engine", "engine.stats() read off the stepping thread"
        return live()

    monkeypatch.setattr(async_engine.engine, "stats", stepping_thread_only)
    before = async_engine.stats().generation_tokens
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True, **GREEDY}
    assert client.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 5
    assert async_engine.stats().generation_tokens == before + 5
    assert metric(client.get("/metrics").text, "vllm:generation_tokens_total", model_name="tiny") == before + 5


def test_chat_uses_the_template_and_streams_the_same_answer(client, async_engine):
    tok = async_engine.engine.tokenizer
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list"}]
    body = {"messages": messages, "max_completion_tokens": 10, "ignore_eos": True, **GREEDY}
    answer = client.post("/v1/chat/completions", json=body).json()
    assert answer["object"] == "chat.completion" and answer["id"].startswith("chatcmpl-")
    message = answer["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<｜Assistant｜>")
    assert answer["usage"]["prompt_tokens"] == len(tok(text, add_special_tokens=False)["input_ids"])
    assert answer["usage"]["completion_tokens"] == 10
    events = client.post("/v1/chat/completions", json={**body, "stream": True,
                                                       "stream_options": {"include_usage": True}})
    chunks = sse_events(events.text)
    assert chunks[0]["object"] == "chat.completion.chunk" and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == message["content"]
    assert chunks[-1]["usage"] == answer["usage"]
    # max_tokens (the older name) works too; parts of type text are joined
    parts = [{"role": "user", "content": [{"type": "text", "text": "Sort "}, {"type": "text", "text": "a list"}]}]
    older = client.post("/v1/chat/completions", json={"messages": parts, "max_tokens": 3, **GREEDY}).json()
    assert older["usage"]["completion_tokens"] <= 3


def test_logprobs_of_chosen_tokens(client):
    out = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "logprobs": 1, "ignore_eos": True,
                                               **GREEDY}).json()
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == 6
    assert all(x <= 0 for x in lp["token_logprobs"]) and "".join(lp["tokens"]) == out["choices"][0]["text"]
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                                     "logprobs": True, "ignore_eos": True, **GREEDY}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(c["logprob"] <= 0 and c["top_logprobs"] == [] for c in content)
    plain = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).json()
    assert plain["choices"][0]["logprobs"] is None


def test_stop_strings_cut_the_answer(client):
    body = {"prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, **GREEDY}
    full = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = full.strip()[6:10]
    cut = client.post("/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and stop not in cut["text"] and full.startswith(cut["text"])


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", b'{"prompt": "x", "max_tokens": ', 400, None),  # malformed JSON
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),  # strict types
    ("/v1/completions", {"prompt": 7}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 3}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hello " * 600}, 400, "prompt"),  # longer than the 512-token context
    ("/v1/completions", {"prompt": "x", "max_tokens": 600}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [5, 99999]}, 400, None),  # token id outside the vocabulary
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400,
     "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
])
def test_bad_requests_get_openai_errors(client, path, body, status, param):
    kwargs = {"content": body, "headers": JSON_TYPE} if isinstance(body, bytes) else {"json": body}
    error = assert_openai_error(client.post(path, **kwargs), status)
    if param is not None:
        assert error["param"] == param, error
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_queue_full_is_429_and_shutting_down_is_503(client, async_engine, monkeypatch):
    def full(*args, **kwargs):
        raise QueueFull("the waiting queue is full (8 requests)")

    monkeypatch.setattr(async_engine, "submit", full)
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert assert_openai_error(r, 429)["code"] == "queue_full" and r.headers["retry-after"] == "1"
    monkeypatch.setattr(async_engine, "accepting", False)
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert assert_openai_error(chat, 503)["code"] == "shutting_down"
    assert client.get("/ready").status_code == 503 and client.get("/health").status_code == 200


class FailingStream:
    """A request the engine gives up on after one token."""

    def __init__(self, *args, **kwargs):
        self.finished = False

    async def __aiter__(self):
        yield RequestOutput("r", [5], "partial", prompt_tokens=1, completion_tokens=1)
        self.finished = True
        yield RequestOutput.failure("r", "engine error: out of memory")

    def abort(self):
        self.finished = True


def test_engine_failure_is_500_or_an_error_event(client, async_engine, monkeypatch):
    monkeypatch.setattr(async_engine, "submit", FailingStream)
    error = assert_openai_error(client.post("/v1/completions", json={"prompt": "x"}), 500)
    assert error["type"] == "internal_server_error" and "out of memory" in error["message"]
    r = client.post("/v1/completions", json={"prompt": "x", "stream": True})
    events = sse_events(r.text)
    assert events[0]["choices"][0]["text"] == "partial" and "out of memory" in events[-1]["error"]["message"]


def test_a_failed_step_ends_its_requests_with_a_500_and_the_engine_goes_on(client, async_engine, monkeypatch):
    real_step = async_engine.engine.step
    calls = []

    def fail_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        return real_step()

    monkeypatch.setattr(async_engine.engine, "step", fail_once)
    error = assert_openai_error(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}), 500)
    assert "probability tensor" in error["message"]
    # The same engine thread answers the next request, and nothing of the failed one is left in the cache.
    ok = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert client.get("/ready").status_code == 200 and async_engine.stats().kv_cache_usage == 0


def test_an_engine_whose_steps_keep_failing_stops_and_refuses_new_requests():
    # Its own engine: this one is left dead.
    engine = AsyncEngine(load_engine(TINY_DIR, config=EngineConfig(max_model_len=128, max_num_seqs=2)), "tiny")

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    engine.engine.step = broken
    engine.start()
    with TestClient(create_app(engine)) as c:
        failed = [assert_openai_error(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}), 500)
                  for _ in range(async_engine_module.MAX_FAILED_STEPS)]
        assert all("illegal memory access" in e["message"] for e in failed)
        deadline = time.monotonic() + 10
        while engine.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.get("/ready").status_code == 503
        # Never a request left waiting on a thread that is gone: refused at once.
        error = assert_openai_error(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}), 503)
        assert "engine stopped" in error["message"]
    asyncio.run(engine.shutdown(drain=False, timeout=1))


def test_api_key_guards_v1_only(async_engine):
    with TestClient(create_app(async_engine, api_key="s3cret")) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            assert assert_openai_error(c.get("/v1/models", headers=headers), 401)["code"] == "invalid_api_key"
        assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        for open_path in ("/health", "/ready", "/metrics"):
            assert c.get(open_path).status_code == 200
        assert metric(c.get("/metrics").text, "quantship:http_responses_total", code="401") == 4


def test_metrics_have_vllm_names_and_count_what_was_answered(async_engine):
    with TestClient(create_app(async_engine)) as c:
        before = c.get("/metrics").text
        usages = [c.post("/v1/completions", json={"prompt": f"{i} " + PROMPT, "max_tokens": 3 + i, "ignore_eos": True})
                  .json()["usage"] for i in range(3)]
        c.post("/v1/completions", json={"prompt": "x", "n": 3})
        after = c.get("/metrics").text
    label = {"model_name": "tiny"}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:inter_token_latency_seconds_count", "vllm:request_queue_time_seconds_count",
                 "vllm:time_per_output_token_seconds_count", "vllm:request_prompt_tokens_bucket"):
        metric(after, name, **label)
    for total, key in TOKEN_COUNTERS:
        assert metric(after, total, **label) - metric(before, total, **label) == sum(u[key] for u in usages)
    for hist in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_generation_tokens_count"):
        assert metric(after, hist, **label) == 3  # this app's listener saw exactly these three
    assert metric(after, "vllm:request_success_total", finished_reason="length", **label) == 3
    assert metric(after, "vllm:request_generation_tokens_sum", **label) == sum(u["completion_tokens"] for u in usages)
    assert metric(after, "http_requests_total", handler="/v1/completions", status="2xx") == 3
    assert metric(after, "http_requests_total", handler="/v1/completions", status="4xx") == 1
    assert metric(after, "vllm:cache_config_info", block_size="16") == 1
    assert "vllm:prompt_tokens_total_total" not in after


def test_expert_stats_count_every_routed_token_when_asked(async_engine):
    """serve --expert-stats: per MoE layer and expert, the tokens the router sent there, exactly as the
    model's own router picks them over the same tokens; absent from /metrics unless asked."""
    with TestClient(create_app(async_engine)) as c:
        assert "quantship:moe_expert_tokens" not in c.get("/metrics").text
    config = EngineConfig(max_model_len=512, max_num_seqs=4, enable_prefix_caching=False, expert_stats=True)
    engine = AsyncEngine(load_engine(TINY_DIR, config=config), "tiny")
    engine.start()
    try:
        with TestClient(create_app(engine)) as c:
            answer = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True,
                                                     "temperature": 0, "logprobs": 0}).json()
            text = c.get("/metrics").text
    finally:
        asyncio.run(engine.shutdown(drain=False, timeout=1))
    model = engine.engine.runner.model
    prompt_ids = engine.engine.tokenizer(PROMPT)["input_ids"]
    generated = engine.engine.tokenizer(answer["choices"][0]["text"], add_special_tokens=False)["input_ids"]
    assert len(prompt_ids) == answer["usage"]["prompt_tokens"]
    # Every computed token (the prompt, then each generated token but the last) routed through each layer.
    routed: dict[int, torch.Tensor] = {}
    moe_layers = {i: layer.mlp for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "expert_tokens")}
    hooks = [moe.gate.register_forward_hook(
        lambda _m, _i, out, i=i, n=len(moe.experts):
            routed.__setitem__(i, torch.bincount(out[1].flatten(), minlength=n)))
        for i, moe in moe_layers.items()]
    try:
        with torch.inference_mode():
            model(torch.tensor([(prompt_ids + generated)[:len(prompt_ids) + 5]]))
    finally:
        for hook in hooks:
            hook.remove()
    assert moe_layers and set(routed) == set(moe_layers)
    for layer, counts in routed.items():
        for expert, count in enumerate(counts.tolist()):
            assert metric(text, "quantship:moe_expert_tokens_total", model_name="tiny", layer=str(layer),
                          expert=str(expert)) == count
    top_k = model.config.num_experts_per_tok
    assert metric(text, "quantship:moe_expert_tokens_total") == len(moe_layers) * (len(prompt_ids) + 5) * top_k


# --- --engine vllm ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def w4a16(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve") / "tiny-w4a16"
    quantize("tiny", out, QuantizeOptions(scheme="W4A16", samples=4, seq_len=64))
    return out


def test_vllm_command_for_the_bundled_model():
    cmd = launcher.vllm_command(TINY_DIR, "tiny", "0.0.0.0", 8000, "/usr/bin/vllm")
    assert cmd.argv == ["/usr/bin/vllm", "serve", str(TINY_DIR.resolve()), "--served-model-name", "tiny",
                        "--host", "0.0.0.0", "--port", "8000", "--max-model-len", "2048"]
    assert cmd.env == {} and cmd.notes == ["quantization: none (dense bfloat16 weights)"]


def test_vllm_command_for_a_quantized_checkpoint(w4a16):
    cmd = launcher.vllm_command(w4a16, "tiny-w4a16", "127.0.0.1", 9000, "vllm", max_model_len=1024, api_key="k",
                                max_num_seqs=32, block_size=32, prefix_caching=False, max_queue=10)
    assert cmd.argv == ["vllm", "serve", str(w4a16.resolve()), "--served-model-name", "tiny-w4a16", "--host",
                        "127.0.0.1", "--port", "9000", "--max-model-len", "1024", "--max-num-seqs", "32",
                        "--block-size", "32", "--no-enable-prefix-caching"]
    assert "--quantization" not in cmd.argv and "k" not in cmd.argv  # vLLM reads the scheme from config.json
    assert cmd.env == {"VLLM_API_KEY": "k"}  # the key stays out of argv, where `ps` would show it
    assert "compressed-tensors pack-quantized: int4 group 128 symmetric" in cmd.notes[0]
    assert "max-queue" in cmd.notes[1]


def test_vllm_refuses_bits_it_has_no_kernel_for(tmp_path):
    config = json.loads((TINY_DIR / "config.json").read_text())
    weights = {"num_bits": 3, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantshipError, match="3-bit weights.*--engine native"):
        launcher.vllm_command(tmp_path, "x", "127.0.0.1", 8000)


def test_serve_engine_vllm_execs_vllm_or_says_it_is_missing(w4a16, monkeypatch, capsys):
    monkeypatch.setattr(launcher, "find_vllm", lambda: None)
    assert main(["serve", str(w4a16), "--engine", "vllm"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "vLLM" in err and "not installed" in err

    class Exec(Exception):
        pass

    def fake_exec(path, argv, env):
        raise Exec(argv, env)

    monkeypatch.setattr(launcher, "find_vllm", lambda: "/opt/bin/vllm")
    monkeypatch.setattr(launcher.os, "execve", fake_exec)
    with pytest.raises(Exec) as exec_info:
        main(["serve", str(w4a16), "--engine", "vllm", "--port", "8123", "--api-key", "k"])
    argv, env = exec_info.value.args
    assert argv[:3] == ["/opt/bin/vllm", "serve", str(w4a16.resolve())] and argv[4] == "tiny-w4a16"
    assert env["VLLM_API_KEY"] == "k" and "8123" in argv


# --- real server processes ----------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: str, log_path, *args: str):
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "quantship.cli", "serve", model, "--port",
                                      self.url.rsplit(":", 1)[1], *args], stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited {self.proc.returncode}:\n{self.log()}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise AssertionError(f"server not ready after {timeout}s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess("tiny", tmp_path_factory.mktemp("server") / "server.log", "--max-queue", "8",
                         "--max-num-seqs", "8", "--api-key", "s3cret")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


AUTH = {"Authorization": "Bearer s3cret"}


def scrape(server) -> str:
    return httpx.get(server.url + "/metrics", timeout=10).text


def wait_idle(server, timeout: float = 10.0) -> str:
    """Poll /metrics until nothing runs, waits or holds KV blocks; return the last scrape."""
    deadline = time.monotonic() + timeout
    while True:
        text = scrape(server)
        values = [metric(text, n) for n in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                            "vllm:kv_cache_usage_perc")]
        if values == [0, 0, 0] or time.monotonic() > deadline:
            assert values == [0, 0, 0], f"not idle after {timeout}s: running, waiting, kv = {values}"
            return text
        time.sleep(0.1)


async def _one(client: httpx.AsyncClient, i: int) -> tuple[int, dict | None]:
    """Request i of the load: chat or completion, streamed or not; (status, usage)."""
    chat, stream = i % 2 == 0, i % 3 == 0
    # The first 6 are long and hold 6 of the 8 batch slots: the short ones behind them share 2 slots
    # and the queue of 8, which a burst of 300 overflows (429s) while many still get through.
    long = i < 6
    body = {"max_tokens": 96 if long else 2 + i % 5, "ignore_eos": long, "temperature": 0.0 if i % 4 else 0.8,
            "seed": i, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}]
    else:
        body["prompt"] = f"# task {i}\ndef f{i}(x):"
    if stream:
        body["stream_options"] = {"include_usage": True}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with client.stream("POST", path, json=body) as r:
        raw = (await r.aread()).decode()
    if r.status_code == 429:
        assert r.headers["retry-after"] and json.loads(raw)["error"]["code"] == "queue_full"
        return 429, None
    assert r.status_code == 200, raw
    if not stream:
        answer = json.loads(raw)
        finish, used = answer["choices"][0]["finish_reason"], answer["usage"]
    else:
        chunks = sse_events(raw)
        assert chunks[-1]["choices"] == []
        finish, used = chunks[-2]["choices"][0]["finish_reason"], chunks[-1]["usage"]
    assert finish in ("stop", "length") and used["completion_tokens"] <= body["max_tokens"]
    assert not long or used["completion_tokens"] == 96
    return 200, used


def test_load_every_request_answered_or_refused_and_counters_match_usage(server):
    before = wait_idle(server)

    async def load(n: int):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=50)
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60, limits=limits) as client:
            return await asyncio.wait_for(asyncio.gather(*(_one(client, i) for i in range(n))), timeout=120)

    results = asyncio.run(load(300))
    answered = [u for status, u in results if status == 200]
    refused = sum(1 for status, _ in results if status == 429)
    assert len(answered) + refused == 300 and len(answered) >= 8 and refused >= 1, (len(answered), refused)
    after = wait_idle(server)
    for total, key in TOKEN_COUNTERS:
        assert metric(after, total) - metric(before, total) == sum(u[key] for u in answered), total
    codes = [metric(text, "quantship:http_responses_total", 0.0, code="429") for text in (before, after)]
    assert codes[1] - codes[0] == refused
    print(f"{len(answered)} answered, {refused} refused with 429")


def test_disconnected_clients_are_cancelled_and_free_their_blocks(server):
    wait_idle(server)
    aborted_before = sum_aborts(scrape(server))
    body = {"prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    started = time.monotonic()
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as client:
        for _ in range(3):  # read two chunks of each stream, then hang up
            with client.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ") and next(line for line in lines if line)
        assert metric(scrape(server), "vllm:kv_cache_usage_perc") >= 0  # still serving
        with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up after 1 s
            client.post("/v1/completions", json={**body, "stream": False}, timeout=1.0)
    text = wait_idle(server, timeout=5)
    assert time.monotonic() - started < 15  # 4 x 1500 tokens would take far longer on CPU
    assert sum_aborts(text) - aborted_before == 4


def sum_aborts(text: str) -> float:
    return metric(text, "vllm:request_success_total", 0.0, finished_reason="abort")


def test_faults_get_errors_and_the_server_keeps_serving(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as c:
        post = c.post
        assert_openai_error(post("/v1/completions", content=b"{nope", headers=JSON_TYPE), 400)
        assert_openai_error(post("/v1/completions", json={"prompt": "x", "max_tokens": "many"}), 400)
        assert_openai_error(post("/v1/completions", json={"prompt": "x", "max_tokens": -5}), 400)
        hello = [{"role": "user", "content": "x"}]
        assert_openai_error(post("/v1/chat/completions", json={"model": "nope", "messages": hello}), 404)
        assert assert_openai_error(post("/v1/completions", json={"prompt": "word " * 5000}),
                                   400)["code"] == "context_length_exceeded"
        assert_openai_error(c.get("/v1/nothing-here"), 404)
        ok = post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    wait_idle(server)


def test_api_key_required_on_v1_but_not_on_metrics_health_ready(server):
    assert assert_openai_error(httpx.post(server.url + "/v1/completions", json={"prompt": "x"}), 401)
    assert httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
    for path in ("/metrics", "/health", "/ready"):
        assert httpx.get(server.url + path).status_code == 200
    assert httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"][0]["id"] == "tiny"


def test_sigterm_finishes_in_flight_requests_then_exits_0(w4a16, tmp_path):
    server = ServerProcess(str(w4a16), tmp_path / "server.log", "--max-num-seqs", "4")
    try:
        server.wait_ready()
        results = {}

        def ask(key: str, body: dict) -> None:
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
            results[key] = (r.status_code, r.text)

        long_body = {"model": "tiny-w4a16", "prompt": PROMPT, "max_tokens": 64, "ignore_eos": True}
        threads = [threading.Thread(target=ask, args=("json", long_body)),
                   threading.Thread(target=ask, args=("sse", {**long_body, "stream": True}))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while metric(scrape(server), "vllm:num_requests_running") < 2:
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.05)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        late = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
        assert assert_openai_error(late, 503)["code"] == "shutting_down"
        assert httpx.get(server.url + "/ready", timeout=10).status_code == 503
        for t in threads:
            t.join(timeout=60)
        status, text = results["json"]
        assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 64
        status, text = results["sse"]
        assert status == 200 and sse_events(text)[-1]["choices"][0]["finish_reason"] == "length"
        assert server.proc.wait(timeout=30) == 0, server.log()
        log = server.log()
        assert "KV cache:" in log and "bytes per token" in log and "SIGTERM" in log
    finally:
        server.stop()



def test_injected_faults_show_in_the_metrics_a_canary_gate_reads(async_engine):
    """A drill server: its added latency counts in the server's own TTFT, its 500s in http_requests_total."""
    app = create_app(async_engine, faults={"latency_s": 0.2, "error_rate": 0.5})
    with TestClient(app) as c:
        codes = [c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code for _ in range(12)]
        text = c.get("/metrics").text
    ok = codes.count(200)
    assert codes == [200, 500] * 6  # failures spread evenly, the first request gets through
    assert metric(text, "http_requests_total", handler="/v1/completions", status="5xx") == 12 - ok
    ttft = metric(text, "vllm:time_to_first_token_seconds_sum", model_name="tiny")
    assert metric(text, "vllm:time_to_first_token_seconds_count", model_name="tiny") == ok
    assert ttft >= 0.2 * ok  # the delay sits inside the measured latency


def test_request_timeout_stops_the_request_and_frees_its_blocks(async_engine):
    with TestClient(create_app(async_engine, request_timeout_s=0.3)) as c:
        body = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}).json()
        assert body["choices"][0]["finish_reason"] == "timeout"
        assert 0 < body["usage"]["completion_tokens"] < 400
        deadline = time.monotonic() + 5
        while async_engine.stats().kv_cache_usage > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert async_engine.stats().kv_cache_usage == 0
