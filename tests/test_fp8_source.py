"""DeepSeek's published FP8 block layout as a source: read, dequantized layer by layer, through every command."""

import asyncio
import json

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

from quantship.cli import main
from quantship.errors import QuantshipError
from quantship.models.bundled import TINY_DIR
from quantship.models.fp8_block import dequantize_blocks
from quantship.models.loader import Checkpoint
from quantship.models.reference_loop import generate_tokens
from quantship.quant.pipeline import QuantizeOptions, quantize
from quantship.verify.compare import quick_fidelity
from quantship.verify.run import VerifyOptions, verify

from fp8_models import convert_to_fp8

FAST = dict(samples=8, seq_len=128)


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    return convert_to_fp8(TINY_DIR, tmp_path_factory.mktemp("fp8") / "tiny-fp8")


@pytest.fixture(scope="module")
def w4_from_fp8(fp8, tmp_path_factory):
    out = tmp_path_factory.mktemp("w4") / "w4"
    quantize(fp8, out, QuantizeOptions(scheme="W4A16", **FAST))
    return out


def _by_hand(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out, inp = values.shape
    return values.float() * scale.repeat_interleave(128, 0)[:out].repeat_interleave(128, 1)[:, :inp]


def test_block_arithmetic_with_partial_edge_blocks():
    values = (torch.randn(200, 300) * 50).to(torch.float8_e4m3fn)
    scale = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    w = dequantize_blocks(values, scale, (128, 128))
    assert w[0, 0] == values[0, 0].float() * 1 and w[127, 128] == values[127, 128].float() * 2
    assert w[128, 0] == values[128, 0].float() * 4 and w[199, 299] == values[199, 299].float() * 6
    torch.testing.assert_close(w, _by_hand(values, scale), rtol=0, atol=0)


def test_a_held_linear_keeps_its_stored_dtype_and_widens_exactly():
    """HeldLinear (the quantizer's routed experts) stays float8 / bf16 under .to(float32) and computes
    what the float32 weight would: the same dequantization, bit for bit."""
    from quantship.models.held import HeldLinear, float32_weight

    values = (torch.randn(200, 300) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 3) + 0.5
    fp8 = HeldLinear(300, 200, (128, 128))
    fp8.load_state_dict({"weight": values, "weight_scale_inv": scale}, assign=True)
    bf16 = HeldLinear(300, 200)
    bf16.load_state_dict({"weight": torch.randn(200, 300).bfloat16()}, assign=True)
    x = torch.randn(5, 300)
    for layer, stored, widened in ((fp8, torch.float8_e4m3fn, dequantize_blocks(values, scale, (128, 128))),
                                   (bf16, torch.bfloat16, bf16.weight.float())):
        layer.to(torch.float32)
        assert layer.weight.dtype == stored and isinstance(layer, torch.nn.Linear)
        assert torch.equal(float32_weight(layer), widened)
        assert torch.equal(layer(x), torch.nn.functional.linear(x, widened))


def test_layers_are_dequantized_exactly(fp8):
    ck = Checkpoint(fp8)
    raw = ck.read([n for n in ck.layer_tensors[1]])
    layer = ck.layer(1)
    checked = 0
    for name, module in layer.named_modules():
        key = f"model.layers.1.{name}.weight"
        if isinstance(module, torch.nn.Linear) and key + "_scale_inv" in raw:
            torch.testing.assert_close(module.weight, _by_hand(raw[key], raw[key + "_scale_inv"]), rtol=0, atol=0)
            checked += 1
    assert checked == 5 + 8 * 3 + 3  # MLA projections, experts, shared expert; the router stays bf16
    assert raw["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    # kv_a_proj_with_mqa has 128 + 16 output rows: its second block row is partial.
    assert raw["model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (2, 3)


def test_logits_within_fp8_error_of_the_bf16_original(fp8):
    fp8_vs_bf16 = quick_fidelity("tiny", fp8, max_tokens=1024)
    assert 0 < fp8_vs_bf16["kl_mean"] < 0.01 and fp8_vs_bf16["top1_agreement"] > 0.95
    assert abs(fp8_vs_bf16["ppl_quant"] / fp8_vs_bf16["ppl_base"] - 1) < 0.01


def test_info_says_fp8_block_source(fp8, capsys):
    assert main(["info", str(fp8), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["fp8_block_source"] == {"weight_block_size": [128, 128], "fp8_linears": 8 + 7 * 32 + 32}
    assert main(["info", str(fp8)]) == 0
    assert "FP8 block source" in capsys.readouterr().out


def test_quantize_then_verify_against_the_fp8_original(fp8, w4_from_fp8):
    ck = Checkpoint(w4_from_fp8)
    qc = ck.config.raw["quantization_config"]
    # The decoder layers are W4A16; the MTP layer is kept in its published FP8 blocks (--mtp keep), so the
    # checkpoint as a whole is mixed-precision with one group per format.
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "mixed-precision"
    formats = {g["format"]: g for g in qc["config_groups"].values()}
    assert set(formats) == {"pack-quantized", "float-quantized"}
    assert formats["pack-quantized"]["weights"]["num_bits"] == 4
    assert formats["float-quantized"]["targets"] == [r"re:model\.layers\.8\.(self_attn|mlp)\."]
    assert not any(n.endswith("weight_scale_inv") for n in ck.files)
    assert ck.files and all(ck.read([n])[n].dtype != torch.float8_e4m3fn for n in list(ck.files)[:50])
    report = verify(fp8, w4_from_fp8, VerifyOptions(max_tokens=1024, sensitivity=False, generations=False,
                                                    bootstrap=100))
    assert report["base"] == str(fp8) and 0.005 < report["headline"]["kl_mean"] < 0.2
    assert report["headline"]["top1_agreement"] > 0.8


def test_generate_and_serve_the_fp8_source(fp8, capsys):
    from quantship.engine.async_engine import AsyncEngine
    from quantship.engine.config import EngineConfig
    from quantship.engine.engine import load_engine
    from quantship.server.app import create_app

    assert main(["generate", str(fp8), "--prompt", "def add(a, b):", "--max-tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("def add(a, b):")
    engine = AsyncEngine(load_engine(fp8, config=EngineConfig(max_model_len=256, max_num_seqs=4)), "fp8")
    engine.start()
    try:
        with TestClient(create_app(engine)) as client:
            body = {"model": "fp8", "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            answer = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    finally:
        asyncio.run(engine.shutdown(drain=False, timeout=1))
    tokenizer = engine.engine.tokenizer
    reference = generate_tokens(Checkpoint(fp8).load_model(), tokenizer("def add(a, b):")["input_ids"], 8)
    assert answer == tokenizer.decode(list(reference), skip_special_tokens=True)


def test_deploy_takes_the_fp8_source(fp8, tmp_path, capsys):
    assert main(["deploy", str(fp8), "-o", str(tmp_path / "k8s")]) == 0
    assert (tmp_path / "k8s").is_dir()


def _broken_copy(fp8, tmp_path, edit) -> str:
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(fp8, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"]
    shard = bad / index["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, str(shard))
    return str(bad)


@pytest.mark.parametrize("edit,expected", [
    (lambda t: t.update({"model.layers.0.self_attn.o_proj.weight_scale_inv": torch.ones(1, 1)}),
     "o_proj.weight_scale_inv has shape [1, 1]; 128x128 blocks over [384, 256] need [3, 2]"),
    (lambda t: t.pop("model.layers.0.self_attn.o_proj.weight_scale_inv"),
     "model.layers.0.self_attn.o_proj.weight is float8 without a weight_scale_inv"),
])
def test_broken_fp8_tensors_are_one_line_errors(fp8, tmp_path, capsys, edit, expected):
    bad = _broken_copy(fp8, tmp_path, edit)
    if "without" in expected:  # the index still names the removed tensor: drop it there too
        index_path = tmp_path / "bad" / "model.safetensors.index.json"
        index = json.loads(index_path.read_text())
        index["weight_map"].pop("model.layers.0.self_attn.o_proj.weight_scale_inv")
        index_path.write_text(json.dumps(index))
    with pytest.raises(QuantshipError, match="model.layers.0"):
        Checkpoint(bad).layer(0)
    capsys.readouterr()
    assert main(["generate", bad, "--prompt", "x", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert expected in err and len(err.strip().splitlines()) == 1, err


def test_unsupported_fp8_config_is_refused(fp8, tmp_path, capsys):
    import shutil

    bad = tmp_path / "e5m2"
    shutil.copytree(fp8, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["fmt"] = "e5m2"
    (bad / "config.json").write_text(json.dumps(config))
    assert main(["info", str(bad)]) == 2
    assert "fmt 'e5m2' is not supported" in capsys.readouterr().err
