"""AWQ: folding scales leaves the layer's function unchanged, and the searched scales beat plain RTN."""

import copy
import dataclasses

import pytest
import torch
from torch import nn

from quantship.models.bundled import TINY_DIR
from quantship.models.causal_lm import build_layer
from quantship.models.deepseek import MoE
from quantship.models.loader import Checkpoint
from quantship.models.tokenizer import load_tokenizer
from quantship.quant.awq import apply_scales, awq_layer, balance_groups
from quantship.quant.rtn import rtn_quantize
from quantship.quantized_tensor import WeightQuant

W4G128 = WeightQuant(4, "int", True, "group", 128)


def _random_scales(layer, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {grp.name: torch.exp(torch.randn(grp.linears[0].in_features, generator=g)) for grp in balance_groups(layer)}


def _routing(layer, x):
    return layer.mlp.gate(layer.post_attention_layernorm(x).reshape(-1, x.shape[-1]))[1]


def _check_fold_exact(layer):
    x, pos = torch.randn(2, 16, layer.input_layernorm.weight.shape[0]), torch.arange(16)
    with torch.no_grad():
        before = layer(x, pos)
        routes = _routing(layer, x) if isinstance(layer.mlp, MoE) else None
        apply_scales(layer, _random_scales(layer))
        torch.testing.assert_close(layer(x, pos), before, atol=1e-5, rtol=1e-5)
        if routes is not None:
            assert torch.equal(_routing(layer, x), routes)  # router compensated: same experts chosen


@pytest.mark.parametrize("name,index", [("deepseek_v3", 0), ("deepseek_v3", 1), ("deepseek_v3_no_q_lora", 1),
                                        ("deepseek_v2_group", 2), ("llama", 1)])
def test_folding_random_scales_is_exact(reference_dirs, name, index):
    layer = Checkpoint(reference_dirs[name][0]).layer(index)
    names = {g.name for g in balance_groups(layer)}
    assert ("self_attn.o_proj" in names) == (name != "llama")  # the reference Llama uses GQA: skipped
    if isinstance(layer.mlp, MoE):
        assert {"mlp.experts.7.down_proj", "mlp.shared_experts.down_proj"} <= names
    _check_fold_exact(layer)


def test_folding_llama_mha_v_to_o(reference_dirs):
    """With as many kv heads as heads, v_proj's rows carry o_proj's scales (and biases must follow)."""
    config = dataclasses.replace(Checkpoint(reference_dirs["llama"][0]).config, num_key_value_heads=4,
                                 attention_bias=True)
    torch.manual_seed(0)
    layer = build_layer(config, 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    assert "self_attn.o_proj" in {g.name for g in balance_groups(layer)}
    _check_fold_exact(layer)


def _rtn_all(layer):
    """RTN every Linear of the layer (the router is not an nn.Linear, so it stays float, as in the schemes)."""
    for m in layer.modules():
        if isinstance(m, nn.Linear):
            m.weight.data = rtn_quantize(m.weight.data, W4G128).dequantize(m.weight.dtype)
    return layer


@pytest.fixture(scope="module")
def tiny_inputs():
    """Layers 0 (dense) and 3 (MoE) of the bundled model with their inputs on 4 x 256 calibration tokens."""
    ck = Checkpoint(TINY_DIR)
    text = (TINY_DIR / "calib.txt").read_text(encoding="utf-8")[:40_000]
    ids = torch.tensor(load_tokenizer(TINY_DIR)(text)["input_ids"][: 4 * 256]).view(4, 256)
    x = nn.functional.embedding(ids, ck.tensor("model.embed_tokens.weight").float())
    pos, out = torch.arange(256), {}
    with torch.no_grad():
        for i in range(4):
            layer = ck.layer(i)
            if i in (0, 3):
                out[i] = (layer, x)
            x = layer(x, pos)
    return out, pos


@pytest.mark.parametrize("index", [0, 3])
def test_awq_beats_rtn_on_tiny_model(tiny_inputs, index):
    (layer, x), pos = tiny_inputs[0][index], tiny_inputs[1]
    with torch.no_grad():
        ref = layer(x, pos)
        rtn_mse = (_rtn_all(copy.deepcopy(layer))(x, pos) - ref).pow(2).mean().item()
        scaled = copy.deepcopy(layer)
        report = awq_layer(scaled, x, pos, W4G128)
        # Before quantizing, the scaled layer computes what the original did.
        torch.testing.assert_close(scaled(x, pos), ref, atol=1e-4, rtol=1e-4)
        awq_mse = (_rtn_all(scaled)(x, pos) - ref).pow(2).mean().item()
    assert any(v["ratio"] > 0 for k, v in report.items() if k != "expert_fallbacks")
    print(f"layer {index}: RTN {rtn_mse:.4e}  AWQ {awq_mse:.4e}  ratio {awq_mse / rtn_mse:.3f}")
    assert awq_mse < rtn_mse


def test_report_structure_fallbacks_and_finite(reference_dirs):
    layer = Checkpoint(reference_dirs["deepseek_v3"][0]).layer(1, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.post_attention_layernorm.weight[5] = 0  # a dead channel: mean |x| = 0 must not give inf/nan
    torch.manual_seed(0)
    hidden = torch.randn(3, 32, 128, dtype=torch.bfloat16)
    args = WeightQuant(4, "int", True, "group", 32)
    report = awq_layer(layer, hidden, torch.arange(32), args, grid=10, max_tokens=64, min_expert_tokens=10**6)
    assert report.pop("expert_fallbacks") == list(range(8))
    assert set(report) == {g.name for g in balance_groups(layer)}
    for entry in report.values():
        assert 0 <= entry["ratio"] < 1
        assert entry["awq_mse"] <= entry["rtn_mse"]
    assert all(p.dtype == torch.bfloat16 and torch.isfinite(p).all() for p in layer.parameters())
    # With a low threshold, experts that saw tokens use only those: fewer fallbacks.
    few = awq_layer(Checkpoint(reference_dirs["deepseek_v3"][0]).layer(1), hidden.float(), torch.arange(32), args,
                    grid=4, min_expert_tokens=1)
    assert len(few["expert_fallbacks"]) < 8


def test_clipping_in_row_chunks_equals_one_pass():
    from quantship.quant.clip import clip_weight
    from quantship.quantized_tensor import WeightQuant

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 256, generator=g)
    weight[::5, ::7] *= 6  # outliers worth clipping
    x = torch.randn(64, 256, generator=g)
    for args in (WeightQuant(num_bits=4, group_size=64), WeightQuant(num_bits=4, strategy="channel")):
        whole, ratio = clip_weight(weight, x, args, chunk_bytes=1 << 40)
        # A budget of a few rows per chunk (and one that does not divide the 48 rows).
        chunked, chunked_ratio = clip_weight(weight, x, args, chunk_bytes=4 * 64 * (256 // args.group_width(256)) * 5)
        torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-6)
        assert abs(chunked_ratio - ratio) < 1e-6 and ratio < 1.0  # and some group was clipped


def test_clipping_rows_kept_from_calibration_do_not_hold_the_batches():
    """The rows AWQ keeps for clipping are copies: a view of each batch's input would keep every batch of
    every Linear's input alive until the layer is done."""
    from quantship.quant.calibrate import InputStats

    stats = InputStats(keep=12, stride=16)
    for _ in range(3):
        stats.add(torch.randn(2, 32, 64), want_hessian=False)
    rows = stats.rows()
    assert rows.shape == (12, 64)
    # Each kept piece owns exactly its rows' bytes, not the [64, 64] batch it came from.
    assert [t.untyped_storage().nbytes() for t in stats.sample] == [4 * 64 * 4] * 3
