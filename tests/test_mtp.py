"""DeepSeek-V3's multi-token-prediction layer: reported, kept in the source precision, quantized or dropped."""

import json

import pytest
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationScheme

from quantship.cli import main
from quantship.models.bundled import TINY_DIR
from quantship.models.fp8_block import Fp8BlockLinear
from quantship.models.loader import Checkpoint
from quantship.quant import mtp as M
from quantship.quant.pipeline import QuantizeOptions, quantize

from fp8_models import convert_to_fp8

FAST = dict(samples=4, seq_len=64)
MTP = 8  # the bundled model has 8 main layers: its MTP layer is model.layers.8, as V3's is 61


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return {"fp8": convert_to_fp8(TINY_DIR, root / "fp8"), "bf16": convert_to_fp8(TINY_DIR, root / "bf16", fp8=False)}


@pytest.fixture(scope="module")
def outputs(sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp-out")
    runs = {"fp8-keep": ("fp8", "keep", "rtn"), "bf16-keep": ("bf16", "keep", "rtn"),
            "fp8-quantize": ("fp8", "quantize", "gptq"), "fp8-drop": ("fp8", "drop", "rtn")}
    out = {}
    for name, (source, mode, method) in runs.items():
        out[name] = root / name
        quantize(sources[source], out[name], QuantizeOptions(mtp=mode, method=method, **FAST))
    return out


def _recipe(path):
    return json.loads((path / "quantship_recipe.json").read_text())


def _names(ck, index=MTP):
    return {n for n in ck.files if n.startswith(f"model.layers.{index}.")}


def test_info_reports_the_mtp_layer(sources, capsys):
    assert main(["info", str(sources["fp8"]), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["mtp"]["declared"] == 1 and info["mtp"]["layers"] == [MTP] and info["mtp"]["parameters"] > 4e6
    assert info["layers"] == 8  # the main model, which verify and the engine run


def test_keep_copies_fp8_blocks_as_fp8_block(sources, outputs):
    src, ck = Checkpoint(sources["fp8"]), Checkpoint(outputs["fp8-keep"])
    assert ck.config.num_nextn_predict_layers == 1
    assert _recipe(outputs["fp8-keep"])["mtp"] == {"mode": "keep", "layers": [MTP],
                                                   "stored_as": "FP8_BLOCK, the source's own FP8 blocks"}
    renamed = {n.replace("weight_scale_inv", "weight_scale") for n in _names(src)}
    assert _names(ck) == renamed
    original = src.read(sorted(_names(src)))
    for name, tensor in ck.read(sorted(_names(ck))).items():
        before = original.get(name, original.get(name + "_inv"))
        assert before.dtype == tensor.dtype and torch.equal(before.view(torch.uint8), tensor.view(torch.uint8)), name
    qc = ck.config.raw["quantization_config"]
    assert qc["format"] == "mixed-precision"
    group = qc["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == "block" and group["format"] == "float-quantized"
    assert group["targets"] == [f"re:model\\.layers\\.{MTP}\\.(self_attn|mlp)\\."]
    assert set(M.MTP_IGNORE) <= set(qc["ignore"])
    # compressed-tensors' own decompressor and our FP8 block Linear read the same weights as the source.
    compressor = BaseCompressor.get_value_from_registry("float-quantized")
    scheme = QuantizationScheme.model_validate(group)
    ours, theirs = ck.mtp_layer(MTP), src.mtp_layer(MTP)
    name = "self_attn.kv_a_proj_with_mqa"  # 144 rows: a partial edge block
    stored = ck.read([f"model.layers.{MTP}.{name}.weight", f"model.layers.{MTP}.{name}.weight_scale"])
    library = compressor.decompress({k.rsplit(".", 1)[1]: v for k, v in stored.items()}, scheme)["weight"]
    assert isinstance(ours.get_submodule(name), Fp8BlockLinear)
    for weight in (library.float(), ours.get_submodule(name).dequantized_weight(torch.float32)):
        torch.testing.assert_close(weight, theirs.get_submodule(name).weight, rtol=0, atol=0)
    assert ck.load_model().config.num_hidden_layers == 8


def test_keep_from_bf16_ignores_the_layer(sources, outputs):
    src, ck = Checkpoint(sources["bf16"]), Checkpoint(outputs["bf16-keep"])
    assert _names(ck) == _names(src)
    for name, tensor in ck.read(sorted(_names(ck))).items():
        assert torch.equal(tensor, src.tensor(name)), name
    qc = ck.config.raw["quantization_config"]
    assert M.layer_pattern(MTP) in qc["ignore"] and list(qc["config_groups"]) == ["group_0"]
    assert _recipe(outputs["bf16-keep"])["mtp"]["stored_as"] == "the source dtype"


def test_quantize_calibrates_the_block_on_what_it_reads(sources, outputs):
    ck = Checkpoint(outputs["fp8-quantize"])
    recipe = _recipe(outputs["fp8-quantize"])
    assert recipe["quantized_linears"] == 232 + 32 and recipe["mtp"]["mode"] == "quantize"
    assert f"model.layers.{MTP}.self_attn.q_a_proj.weight_packed" in ck.files
    assert ck.tensor(f"model.layers.{MTP}.eh_proj.weight").dtype == torch.bfloat16
    assert f"model.layers.{MTP}.shared_head.head.weight" in ck.files and ck.config.num_nextn_predict_layers == 1
    quantized, original = ck.mtp_layer(MTP), Checkpoint(sources["fp8"]).mtp_layer(MTP)
    for name in ("self_attn.q_b_proj", "mlp.experts.3.down_proj"):
        w, q = original.get_submodule(name).weight, quantized.get_submodule(name).dequantized_weight(torch.float32)
        assert 0 < (q - w).norm() / w.norm() < 0.3, name  # GPTQ trades weight error for output error


def test_calibration_input_is_the_shifted_embedding_beside_the_normed_output(sources):
    ck = Checkpoint(sources["bf16"])
    model, layer = ck.load_model(), ck.mtp_layer(MTP)
    ids = torch.randint(3, 8192, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        x = model.model.embed_tokens(ids)
        for i, block in enumerate(model.model.layers):
            x = block(x, torch.arange(20))
        got = M.calibration_input(layer, ids, x, model.model.norm.weight, ck.config.rms_norm_eps)
        normed = model.hidden_states(ids)
        embeds = layer.embed_tokens(ids[:, 1:])
        embeds[:, 0] = 0
        expected = layer.eh_proj(torch.cat((layer.enorm(embeds), layer.hnorm(normed[:, :-1])), dim=-1))
    assert got.shape == (2, 19, 384)
    torch.testing.assert_close(got, expected)


def test_drop_writes_no_mtp_and_sets_the_field_to_zero(outputs):
    ck = Checkpoint(outputs["fp8-drop"])
    assert not _names(ck) and ck.config.num_nextn_predict_layers == 0
    assert _recipe(outputs["fp8-drop"])["mtp"] == {"mode": "drop", "layers": [], "stored_as": "dropped"}


def test_cli_flag_and_bad_mode(sources, tmp_path, capsys):
    assert main(["quantize", str(sources["fp8"]), "-o", str(tmp_path / "bad"), "--mtp", "maybe", "--quiet"]) == 2
    assert "invalid choice" in capsys.readouterr().err and not (tmp_path / "bad").exists()
