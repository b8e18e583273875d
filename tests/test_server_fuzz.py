"""The completion endpoints under hostile input: numbers out of range and unsupported features are a
400 naming `param`, and a property-based fuzz of both endpoints (hypothesis, a fixed number of
examples, derandomized so CI runs the same ones) finds no 5xx, no error hidden in a 200 stream, a
server that keeps answering, and every KV block freed afterwards."""

import asyncio
import json
import math
import os
import time

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from quantship.engine.async_engine import AsyncEngine
from quantship.engine.config import EngineConfig
from quantship.engine.engine import load_engine
from quantship.models.bundled import TINY_DIR
from quantship.models.config import load_config
from quantship.server.app import create_app

EXAMPLES = int(os.environ.get("QUANTSHIP_FUZZ_EXAMPLES", "150"))  # per endpoint; raise it for a deeper run
MAX_MODEL_LEN = 128  # short, so a body that asks for "the rest of the context" still ends quickly
INT64 = 2**63


@pytest.fixture(scope="module")
def served():
    engine = AsyncEngine(load_engine(TINY_DIR, config=EngineConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=8)),
                         "tiny")
    engine.start()
    # The request timeout bounds the rare valid body that generates up to the context on a busy CPU.
    with TestClient(create_app(engine, request_timeout_s=10)) as client:
        yield client, engine
    asyncio.run(engine.shutdown(drain=False, timeout=1))


def post(client, path: str, body):
    """JSON as Python writes it: NaN and Infinity included (httpx refuses them; Python's json.loads accepts them)."""
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


# --- each class of bad number or unsupported feature: a 400 naming the field -------------------------

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "def f(x):", "max_tokens": 2}
REFUSED = [
    ("seed", INT64), ("seed", 2**64 + 5), ("seed", -INT64 - 1), ("priority", INT64), ("top_k", INT64),
    ("n", 10**30), ("best_of", 10**30), ("max_tokens", 10**30), ("stop_token_ids", [INT64]),
    ("stop_token_ids", [-1]), ("temperature", math.nan), ("temperature", math.inf), ("top_p", math.nan),
    ("presence_penalty", math.nan), ("logprobs", 10**30), ("prompt", [0, 10**30]), ("prompt", [-1]),
    ("response_format", {"type": "json_object"}), ("tool_choice", "required"),
    ("tool_choice", {"type": "function", "function": {"name": "f"}}), ("guided_json", {"type": "object"}),
    ("repetition_penalty", 1.3), ("min_tokens", 4), ("use_beam_search", True), ("functions", [{"name": "f"}]),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field,value", REFUSED, ids=[f"{f}={str(v)[:20]}" for f, v in REFUSED])
def test_out_of_range_and_unsupported_fields_are_a_400_naming_the_field(served, field, value, stream):
    client, _ = served
    chat = field not in ("prompt", "best_of", "logprobs")
    path, body = ("/v1/chat/completions", CHAT) if chat else ("/v1/completions", COMPLETION)
    error = error_of(post(client, path, {**body, field: value, "stream": stream}), 400)
    assert error["param"].split(".")[0] == field, error  # nested: "stop_token_ids.0"


@pytest.mark.parametrize("field,value", [("response_format", {"type": "text"}), ("tool_choice", "none"),
                                         ("repetition_penalty", 1.0), ("seed", INT64 - 1), ("seed", -INT64),
                                         ("use_beam_search", False), ("user", "anyone")])
def test_neutral_values_of_those_fields_are_accepted(served, field, value):
    client, _ = served
    response = post(client, "/v1/chat/completions", {**CHAT, field: value, "temperature": 1.0})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] <= 2


# --- the fuzz ----------------------------------------------------------------------------------------

VOCAB = load_config(TINY_DIR).vocab_size
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.integers(-3, 10),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                           max_size=4), max_leaves=8)
# Integers in int64 and just past it: an out-of-range seed once reached torch and came back a 500.
int64 = st.one_of(st.integers(-INT64, INT64 - 1), st.sampled_from([INT64 - 1, INT64, 2**64, -INT64 - 1]),
                  st.integers(-2**70, 2**70))
token_ids = st.lists(st.integers(0, VOCAB - 1), max_size=12)
texts = st.text(max_size=40)
# Bodies that are mostly valid, with small generation lengths so each one costs a few decode steps ...
common = {
    "model": st.sampled_from(["tiny", None]), "temperature": st.one_of(st.none(), st.floats(0, 2)),
    "top_p": st.one_of(st.none(), st.floats(0.01, 1)), "top_k": st.one_of(st.none(), st.integers(-1, 50), int64),
    "seed": st.one_of(st.none(), int64), "n": st.sampled_from([None, 1]),
    "stop": st.one_of(st.none(), st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3)),
    "stop_token_ids": st.one_of(st.none(), st.lists(st.one_of(st.integers(0, VOCAB), int64), max_size=4)),
    "ignore_eos": st.booleans(), "priority": int64, "stream": st.booleans(),
    "stream_options": st.one_of(st.none(), st.fixed_dictionaries({"include_usage": st.booleans()})),
    "response_format": st.sampled_from([None, {"type": "text"}]), "tool_choice": st.sampled_from([None, "none"]),
}
part = st.fixed_dictionaries({"type": st.just("text"), "text": texts})
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant"]),
                                 "content": st.one_of(texts, st.lists(part, max_size=2))})
valid_completion = st.fixed_dictionaries(
    {"prompt": st.one_of(texts, token_ids, st.lists(texts, min_size=1, max_size=1))},
    optional={**common, "max_tokens": st.one_of(st.none(), st.integers(1, 4)),
              "logprobs": st.sampled_from([None, 0, 1]), "echo": st.just(False)})
valid_chat = st.fixed_dictionaries(
    {"messages": st.lists(message, min_size=1, max_size=3), "max_completion_tokens": st.integers(1, 4)},
    optional={**common, "logprobs": st.booleans(), "top_logprobs": st.sampled_from([None, 0])})
# ... and the same bodies with one field (known, unknown or nested) replaced by junk or an edge value.
edges = st.one_of(junk, st.integers(-2**70, 2**70),
                  st.sampled_from([math.nan, math.inf, -math.inf, -1, 0, 2**63, 2**64]))
FIELDS = [*common, "prompt", "messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs", "echo",
          "best_of", "suffix", "presence_penalty", "frequency_penalty", "logit_bias", "tools", "guided_regex",
          "repetition_penalty", "min_p", "x_unknown"]


def mutated(valid):
    def replace(body, field, value):
        if field == "messages" and isinstance(body.get("messages"), list) and isinstance(value, dict):
            return {**body, "messages": [value, *body["messages"]]}  # a junk message among good ones
        return {**body, field: value}

    return st.builds(replace, valid, st.sampled_from(FIELDS), edges)


completion_bodies = st.one_of(valid_completion, mutated(valid_completion))
chat_bodies = st.one_of(valid_chat, mutated(valid_chat))
raw_bodies = st.one_of(st.binary(max_size=60), junk.map(json.dumps))


def check_answer(response) -> None:
    """No 5xx; errors in OpenAI's shape; a 200 stream ends in [DONE] with no error event inside."""
    assert response.status_code < 500, response.text[:500]
    if response.status_code >= 400:
        error_of(response, response.status_code)
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", response.text[-300:]
        assert not any("error" in json.loads(e) for e in events[:-1]), response.text[-500:]
    else:
        assert response.json()["choices"][0]["finish_reason"] in ("stop", "length", "timeout")


# No shrinking: a failure is reported with the body as generated, and a failing run stays as short as
# a passing one (shrinking sends thousands more requests).
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("path,bodies", [("/v1/completions", completion_bodies),
                                         ("/v1/chat/completions", chat_bodies)], ids=["completions", "chat"])
def test_fuzzed_bodies_never_get_a_5xx_and_the_cache_empties(served, path, bodies):
    client, engine = served

    @FUZZ
    @given(body=bodies, raw=raw_bodies)
    def one(body, raw):
        check_answer(post(client, path, body))
        check_answer(client.post(path, content=raw, headers={"content-type": "application/json"}))

    one()
    assert client.get("/health").status_code == 200 and client.get("/ready").status_code == 200
    deadline = time.monotonic() + 30
    while engine.stats().num_running or engine.stats().num_waiting or engine.stats().kv_cache_usage:
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.05)
    usage = [line for line in client.get("/metrics").text.splitlines() if line.startswith("vllm:kv_cache_usage_perc")]
    assert usage and float(usage[0].split()[-1]) == 0.0
