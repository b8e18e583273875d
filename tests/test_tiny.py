"""The bundled trained tiny DeepSeek-V3: a standard checkpoint, matching transformers, and trained."""

import json
import math

import pytest
import torch

from quantship.models.bundled import TINY_DIR, bundled_texts
from quantship.models.info import model_info
from quantship.models.loader import Checkpoint
from quantship.models.tokenizer import load_tokenizer

pytestmark = pytest.mark.skipif(not (TINY_DIR / "config.json").exists(), reason="bundled model not built")


@pytest.fixture(scope="module")
def tiny():
    return Checkpoint(TINY_DIR).load_model()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY_DIR)


def test_shape_is_like_the_real_models():
    c = Checkpoint(TINY_DIR).config
    assert c.architecture == "DeepseekV3ForCausalLM"
    assert c.q_lora_rank and c.kv_lora_rank and c.n_routed_experts >= 8 and c.num_experts_per_tok == 2
    assert c.n_shared_experts == 1 and c.first_k_dense_replace == 1
    # Every Linear input dimension divides by 128, so W4A16 group 128 applies everywhere.
    for dim in (c.hidden_size, c.q_lora_rank, c.kv_lora_rank, c.intermediate_size, c.moe_intermediate_size,
                c.num_attention_heads * c.v_head_dim):
        assert dim % 128 == 0, dim
    info = model_info(TINY_DIR)
    assert 10e6 <= info["parameters"] <= 25e6
    assert info["active_parameters"] < info["parameters"]


def test_shards_are_small_bf16_safetensors():
    index = json.loads((TINY_DIR / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2
    for shard in shards:
        assert (TINY_DIR / shard).stat().st_size <= 16 * 2**20


def test_transformers_loads_it_and_agrees(tiny, tokenizer):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(TINY_DIR, dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer(bundled_texts()["eval_text"].read_text()[:4000])["input_ids"][:300]])
    with torch.no_grad():
        torch.testing.assert_close(tiny(ids), reference(ids).logits, atol=1e-4, rtol=1e-4)


def test_it_is_trained_heldout_perplexity(tiny, tokenizer):
    text = bundled_texts()["eval_text"].read_text()
    ids = torch.tensor([tokenizer(text[:60000])["input_ids"][:1024]])
    with torch.no_grad():
        logits = tiny(ids)
    nll = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).item()
    # Uniform over 8192 tokens would be ln(8192) = 9.0; a trained model is far below.
    assert math.exp(nll) < 60, nll


def test_eval_and_calib_texts_are_disjoint():
    texts = bundled_texts()
    eval_lines = {l.strip() for l in texts["eval_text"].read_text().splitlines() if len(l.strip()) > 60}
    calib_lines = {l.strip() for l in texts["calib_text"].read_text().splitlines() if len(l.strip()) > 60}
    assert eval_lines and calib_lines
    assert len(eval_lines & calib_lines) / len(eval_lines) < 0.01
    assert texts["eval_text"].stat().st_size <= 500_000


def test_chat_template(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)
    assert text.startswith(tokenizer.bos_token) and "hi" in text and text.endswith("<｜Assistant｜>")
