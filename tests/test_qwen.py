"""Qwen2 and Qwen3 (the DeepSeek-R1 distills) through every stage: quantize (AWQ, biases kept), what
transformers reads back, verify, plan, the engine, serve with the R1 <think> chat template, deploy.
Logit parity against transformers is in test_parity.py (CONFIGS qwen2, qwen3, llama3)."""

import asyncio
import json
import shutil

import pytest
import torch
from fastapi.testclient import TestClient

from quantship.cli import main
from quantship.engine.async_engine import AsyncEngine
from quantship.engine.config import EngineConfig
from quantship.engine.engine import LLMEngine, load_engine
from quantship.engine.sampling_params import SamplingParams
from quantship.models.bundled import TINY_DIR
from quantship.models.loader import Checkpoint, load_model
from quantship.models.reference_loop import generate_tokens
from quantship.quant.pipeline import QuantizeOptions, quantize
from quantship.server.app import create_app
from quantship.verify.run import VerifyOptions, verify

FAST = dict(samples=8, seq_len=128)
# The R1 distills' template in short: the generation prompt opens a <think> block, and earlier
# assistant turns are replayed without their reasoning.
R1_TEMPLATE = (
    "{% if add_generation_prompt is not defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{% set content = message['content'] %}"
    "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{ '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}"
)
SHAPES = {
    "qwen2": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                  use_sliding_window=False, tie_word_embeddings=False),
    "qwen3": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=128, tie_word_embeddings=True),
}


def _save_qwen(kind: str, directory):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(kind, vocab_size=8192, num_hidden_layers=2, max_position_embeddings=1024,
                                  bos_token_id=0, eos_token_id=1, **SHAPES[kind])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.5)
            elif p.dim() == 1 and "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "special_tokens_map.json"):
        shutil.copy(TINY_DIR / name, directory / name)
    tokenizer_config = json.loads((TINY_DIR / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = R1_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return directory


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """{kind: (base dir, W4A16 AWQ dir)} for Qwen2 and Qwen3."""
    out = {}
    for kind in SHAPES:
        base = _save_qwen(kind, tmp_path_factory.mktemp(kind))
        quant = tmp_path_factory.mktemp(kind + "-awq") / "w4a16"
        quantize(base, quant, QuantizeOptions(scheme="W4A16", method="awq", **FAST))
        out[kind] = (base, quant)
    return out


@pytest.mark.parametrize("kind", list(SHAPES))
def test_awq_output_keeps_biases_and_transformers_reads_it(qwen, kind):
    from transformers import AutoModelForCausalLM

    base, quant = qwen[kind]
    ck = Checkpoint(quant)
    recipe = json.loads((quant / "quantship_recipe.json").read_text())
    assert recipe["method"] == "awq" and recipe["quantized_linears"] == 2 * 7
    # AWQ balanced q/k/v against the input norm and gate/up against the post-attention norm in every layer.
    assert {k.split(".", 3)[3] for k in recipe["awq"]} >= {"self_attn", "mlp", "mlp.down_proj"}
    biases = sorted(n for n in ck.files if n.endswith(".bias"))
    if kind == "qwen2":
        assert biases == [f"model.layers.{i}.self_attn.{p}_proj.bias" for i in range(2) for p in "kqv"]
    else:
        assert biases == [] and "model.layers.0.self_attn.q_norm.weight" in ck.files
    ours = ck.load_model()
    reference = AutoModelForCausalLM.from_pretrained(quant, dtype=torch.float32).eval()
    ids = torch.arange(1, 120)[None]
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), reference(ids).logits, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("kind", list(SHAPES))
def test_verify_and_plan(qwen, kind, tmp_path):
    base, quant = qwen[kind]
    report = verify(base, quant, VerifyOptions(max_tokens=1024, ctx=512, bootstrap=50, generations=False,
                                               sensitivity_rows=1))
    assert 0 < report["headline"]["kl_mean"] < 1 and report["sensitivity"]
    plan_path = tmp_path / "plan.json"
    assert main(["plan", str(base), "--budget-bits", "6", "-o", str(plan_path)]) == 0
    plan = json.loads(plan_path.read_text())
    assert plan["modules"] and set(plan["modules"].values()) <= {"W4A16", "W8A16", "none"}


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "llama3"])
def test_engine_matches_the_plain_loop(reference_dirs, name):
    model = load_model(reference_dirs[name][0], torch.float64)
    engine = LLMEngine(model, EngineConfig(block_size=4, max_num_batched_tokens=16))
    prompts = [[5, 9, 17, 33, 2, 8, 100], [7] * 23, [1, 2, 3]]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=10, ignore_eos=True))
    got = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    for i, prompt in enumerate(prompts):
        assert got[str(i)] == list(generate_tokens(model, prompt, 10)), f"request {i}"


def test_serve_uses_the_r1_think_template(qwen):
    base, quant = qwen["qwen2"]
    engine = AsyncEngine(load_engine(quant, config=EngineConfig(max_model_len=512, max_num_seqs=4)), "qwen")
    engine.start()
    messages = [{"role": "user", "content": "Add two numbers."},
                {"role": "assistant", "content": "<think>\nplus\n</think>\n\nUse +."},
                {"role": "user", "content": "And three?"}]
    try:
        with TestClient(create_app(engine)) as client:
            answer = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4,
                                                               "temperature": 0, "ignore_eos": True}).json()
    finally:
        asyncio.run(engine.shutdown(drain=False, timeout=1))
    tokenizer = engine.engine.tokenizer
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<｜Assistant｜><think>\n") and "plus" not in text
    assert answer["usage"]["prompt_tokens"] == len(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert answer["usage"]["completion_tokens"] == 4


def test_deploy_and_info(qwen, tmp_path, capsys):
    base, quant = qwen["qwen3"]
    assert main(["info", str(base), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["architecture"] == "Qwen3ForCausalLM" and info["attention"] == "GQA"
    assert main(["deploy", str(quant), "-o", str(tmp_path / "k8s")]) == 0


def test_sliding_window_is_refused_in_one_line(qwen, tmp_path, capsys):
    bad = tmp_path / "sliding"
    shutil.copytree(qwen["qwen2"][0], bad)
    config = json.loads((bad / "config.json").read_text())
    config["use_sliding_window"] = True
    (bad / "config.json").write_text(json.dumps(config))
    assert main(["info", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "sliding-window attention (use_sliding_window) is not supported" in err and len(err.splitlines()) == 1
