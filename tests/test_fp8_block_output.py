"""FP8_BLOCK output: float8 e4m3 weights with 128x128 block scales and per-token-group activations,
written as compressed-tensors float-quantized (block strategy), alone or beside W4A16 in a plan."""

import json

import pytest
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationScheme

from quantship.cli import main
from quantship.models.fp8_block import Fp8BlockLinear, quantize_activations_per_group
from quantship.models.loader import Checkpoint
from quantship.quant.fp8_block import block_quantize
from quantship.quant.pipeline import QuantizeOptions, quantize
from quantship.verify.compare import quick_fidelity

FAST = dict(samples=4, seq_len=64)


@pytest.fixture(scope="module")
def fp8_block(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8block") / "q"
    quantize("tiny", out, QuantizeOptions(scheme="FP8_BLOCK", **FAST))
    return out


def _module(ck, name):
    return {n[len(name) + 1:]: t for n, t in ck.read([n for n in ck.files if n.startswith(name + ".")]).items()}


def test_block_quantize_scales_each_block_to_its_maximum():
    w = torch.randn(200, 300)
    w[150:, 260:] *= 100  # one partial corner block far larger than the rest
    values, scale = block_quantize(w)
    assert values.dtype == torch.float8_e4m3fn and scale.shape == (2, 3) and scale.dtype == torch.float32
    assert scale[1, 2] == w[128:, 256:].abs().max() / 448 and scale[0, 0] == w[:128, :128].abs().max() / 448
    back = values.float() * scale.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    assert ((back - w).abs() <= w.abs() / 16 + scale.max() * 2**-9).all()  # e4m3: 3 mantissa bits


def test_activations_are_quantized_per_token_and_group():
    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(0))
    x[:, 5] = 1e5  # one outlier pushes its own group of 128 into float8's subnormals, and no other group
    q = quantize_activations_per_group(x, 128)
    assert torch.equal(q[:, 5], x[:, 5])
    error = (q - x).abs()
    outlier_group = torch.cat((error[:, :5], error[:, 6:128]), dim=1)
    assert outlier_group.mean() > 3 * error[:, 128:].mean()


def test_config_and_tensors_are_what_vllm_and_compressed_tensors_expect(fp8_block):
    ck = Checkpoint(fp8_block)
    qc = ck.config.raw["quantization_config"]
    assert qc["format"] == "float-quantized"
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"]
    assert group["weights"] == {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
                                "block_structure": [128, 128], "dynamic": False}
    assert group["input_activations"] == {"num_bits": 8, "type": "float", "symmetric": True, "group_size": 128,
                                          "strategy": "group", "dynamic": True}
    compressor = BaseCompressor.get_value_from_registry("float-quantized")
    scheme = QuantizationScheme.model_validate(group)
    layer = ck.layer(1)
    checked = 0
    for local, module in layer.named_modules():
        if not isinstance(module, Fp8BlockLinear):
            continue
        stored = _module(ck, f"model.layers.1.{local}")
        assert stored["weight"].dtype == torch.float8_e4m3fn and stored["weight_scale"].dtype == torch.float32
        weight = compressor.decompress(stored, scheme)["weight"]
        torch.testing.assert_close(weight.float(), module.dequantized_weight(torch.float32), rtol=0, atol=0)
        checked += 1
    # kv_b_proj, which absorbed MLA reads whole in every decode step, is held dequantized once loaded
    kv_b = compressor.decompress(_module(ck, "model.layers.1.self_attn.kv_b_proj"), scheme)["weight"]
    torch.testing.assert_close(kv_b.float(), layer.self_attn.kv_b_proj.weight, rtol=0, atol=0)
    assert checked == 4 + 8 * 3 + 3
    assert _module(ck, "model.layers.1.self_attn.kv_a_proj_with_mqa")["weight_scale"].shape == (2, 3)
    recipe = json.loads((fp8_block / "quantship_recipe.json").read_text())
    assert recipe["schemes_used"] == ["FP8_BLOCK"]


def test_fp8_block_is_near_lossless(fp8_block):
    result = quick_fidelity("tiny", fp8_block, max_tokens=1024)
    # W4A16 RTN measures about 0.045 here; activations quantized per token-group cost a little on top of
    # the weights (the FP8 source, weights only, measures 0.004).
    assert result["kl_mean"] < 0.015 and result["top1_agreement"] > 0.93


def test_plan_keeps_sensitive_layers_in_fp8_block_beside_w4a16(tmp_path):
    plan = {f"model.layers.{i}.self_attn.kv_b_proj": "FP8_BLOCK" for i in range(8)}
    plan.update({f"model.layers.{i}.self_attn.o_proj": "W4A16" for i in range(8)})
    out = tmp_path / "mixed"
    quantize("tiny", out, QuantizeOptions(plan=plan, method="gptq", **FAST))
    ck = Checkpoint(out)
    qc = ck.config.raw["quantization_config"]
    assert qc["format"] == "mixed-precision"
    formats = {g["format"]: sorted(g["targets"]) for g in qc["config_groups"].values()}
    assert formats == {"float-quantized": sorted(n for n, s in plan.items() if s == "FP8_BLOCK"),
                       "pack-quantized": sorted(n for n, s in plan.items() if s == "W4A16")}
    layer = ck.layer(2)
    assert "model.layers.2.self_attn.kv_b_proj.weight_scale" in ck.files  # stored in FP8 blocks
    assert type(layer.self_attn.kv_b_proj) is torch.nn.Linear  # held dequantized once loaded (MLA absorbs it)
    assert "model.layers.2.self_attn.o_proj.weight_packed" in ck.files
    with torch.no_grad():
        assert torch.isfinite(ck.load_model()(torch.arange(1, 40)[None])).all()


def test_fp8_block_with_a_calibrated_method_is_refused(tmp_path, capsys):
    assert main(["quantize", "-o", str(tmp_path / "o"), "--scheme", "FP8_BLOCK", "--method", "gptq", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "FP8_BLOCK is data-free" in err and len(err.strip().splitlines()) == 1
