"""Input dimensions the group size does not divide: fall back to group 64/32, else per channel, as a
second config group that compressed-tensors and transformers read; --strict-groups refuses instead."""

import json
import shutil

import pytest
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationScheme

from quantship.cli import main
from quantship.models.bundled import TINY_DIR
from quantship.models.loader import Checkpoint
from quantship.quant.pipeline import QuantizeOptions, quantize
from quantship.quant.scheme import get_scheme

FAST = dict(samples=4, seq_len=64)


def _save(directory, model_type: str, **shape):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=8192, max_position_embeddings=512, **shape)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TINY_DIR / name, directory / name)
    return directory


@pytest.fixture(scope="module")
def v2_lite_layer(tmp_path_factory):
    """One dense DeepSeek-V2-Lite-shaped layer (down_proj reads 10944 = 85.5 x 128) before one MoE layer."""
    return _save(tmp_path_factory.mktemp("v2lite"), "deepseek_v2", hidden_size=256, intermediate_size=10944,
                 moe_intermediate_size=128, num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
                 num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=128, qk_nope_head_dim=32,
                 qk_rope_head_dim=32, v_head_dim=32, n_routed_experts=4, n_shared_experts=1,
                 num_experts_per_tok=2, topk_method="greedy", norm_topk_prob=False)


def test_fitted_scheme_picks_the_largest_group_that_divides():
    w4 = get_scheme("W4A16")
    assert w4.fitted_to(4096) is w4
    assert w4.fitted_to(10944).weights.group_size == 64
    assert w4.fitted_to(10976).weights.group_size == 32  # 10976 = 343 x 32
    channel = w4.fitted_to(10940)
    assert channel.weights.strategy == "channel" and channel.weights.group_size is None
    assert get_scheme("W4A16", 64).fitted_to(10944).weights.group_size == 64
    assert get_scheme("W8A16").fitted_to(10943) == get_scheme("W8A16")  # per channel already


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_v2_lite_down_proj_falls_back_to_group_64(v2_lite_layer, tmp_path, method, capsys):
    out = tmp_path / "q"
    assert main(["quantize", str(v2_lite_layer), "-o", str(out), "--method", method, "--samples", "4",
                 "--seq-len", "64", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "group fallback: model.layers.0.mlp.down_proj -> group 64" in printed
    recipe = json.loads((out / "quantship_recipe.json").read_text())
    assert recipe["group_fallbacks"] == {"model.layers.0.mlp.down_proj": "group 64"}
    ck = Checkpoint(out)
    qc = ck.config.raw["quantization_config"]
    groups = {g["weights"]["group_size"]: g for g in qc["config_groups"].values()}
    assert set(groups) == {128, 64} and groups[64]["targets"] == ["model.layers.0.mlp.down_proj"]
    assert "model.layers.0.mlp.down_proj" not in groups[128]["targets"]
    stored = {n.rsplit(".", 1)[1]: t for n, t in ck.read([n for n in ck.files
                                                          if n.startswith("model.layers.0.mlp.down_proj.")]).items()}
    assert stored["weight_scale"].shape == (256, 10944 // 64)
    compressor = BaseCompressor.get_value_from_registry(qc["format"])
    library = compressor.decompress(stored, QuantizationScheme.model_validate(groups[64]))["weight"]
    ours = ck.layer(0).mlp.down_proj.dequantized_weight(torch.float32)
    torch.testing.assert_close(library.float(), ours.to(library.dtype).float(), rtol=0, atol=0)


def test_strict_groups_refuses_in_one_line(v2_lite_layer, tmp_path, capsys):
    out = tmp_path / "strict"
    assert main(["quantize", str(v2_lite_layer), "-o", str(out), "--strict-groups", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "does not divide model.layers.0.mlp.down_proj's input dimension 10944 (--strict-groups)" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


@pytest.mark.parametrize("intermediate,expected", [(320, "group 64"), (328, "per channel")])
def test_transformers_reads_the_fallback_groups(tmp_path, intermediate, expected):
    from transformers import AutoModelForCausalLM

    model = _save(tmp_path / "m", "llama", hidden_size=256, intermediate_size=intermediate, num_hidden_layers=1,
                  num_attention_heads=4)
    out = tmp_path / "q"
    recipe = quantize(model, out, QuantizeOptions(**FAST))
    assert recipe["group_fallbacks"] == {"model.layers.0.mlp.down_proj": expected}
    ours = Checkpoint(out).load_model()
    reference = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.arange(1, 100)[None]
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), reference(ids).logits, atol=2e-3, rtol=1e-3)
