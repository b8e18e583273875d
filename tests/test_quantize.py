"""quantize: compressed-tensors output that external readers load, quality per method, bad input."""

import json
import shutil

import pytest
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationScheme
from safetensors.torch import load_file, save_file
from torch import nn

from quantship.cli import main
from quantship.errors import QuantshipError
from quantship.models.bundled import TINY_DIR
from quantship.models.loader import Checkpoint
from quantship.models.quantized import PackedLinear, QuantLinear, runtime_linear
from quantship.quant import pipeline
from quantship.quant.pipeline import QuantizeOptions, quantize
from quantship.verify.compare import quick_fidelity

FAST = dict(samples=16, seq_len=256)


@pytest.fixture(scope="module")
def quants(tmp_path_factory):
    """The bundled model quantized once per scheme (RTN) for the format tests."""
    root = tmp_path_factory.mktemp("quants")
    out = {}
    for scheme in ("W4A16", "W4A16_ASYM", "W8A16", "W8A8", "FP8_DYNAMIC"):
        out[scheme] = root / scheme
        quantize("tiny", out[scheme], QuantizeOptions(scheme=scheme, **FAST))
    return out


def _module_tensors(ck: Checkpoint, name: str) -> dict:
    names = [n for n in ck.files if n.startswith(name + ".")]
    return {n[len(name) + 1:]: t for n, t in ck.read(names).items()}


@pytest.mark.parametrize("scheme", ["W4A16", "W4A16_ASYM", "W8A16", "W8A8", "FP8_DYNAMIC"])
def test_compressed_tensors_library_reads_what_we_wrote(quants, scheme):
    ck = Checkpoint(quants[scheme])
    qc = ck.config.raw["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["quantization_status"] == "compressed"
    assert "lm_head" in qc["ignore"] and any("mlp" in p and "gate" in p for p in qc["ignore"])
    compressor = BaseCompressor.get_value_from_registry(qc["format"])
    library_scheme = QuantizationScheme.model_validate(qc["config_groups"]["group_0"])
    layer = ck.layer(3)
    checked = 0
    for local, module in layer.named_modules():
        if not isinstance(module, (QuantLinear, PackedLinear)):
            continue
        weight = compressor.decompress(_module_tensors(ck, f"model.layers.3.{local}"), library_scheme)["weight"]
        ours = module.dequantized_weight(torch.float32)
        torch.testing.assert_close(weight.float(), ours.to(weight.dtype).float(), rtol=0, atol=0)
        checked += 1
    # every MLA projection but kv_b_proj (held dequantized: test_mla_kv_b_proj_is_served_dequantized_once),
    # every expert (8 x 3) and the shared expert (3) of an MoE layer
    assert checked == 4 + 24 + 3
    # routers and norms stay dense
    assert "model.layers.3.mlp.gate.weight" in ck.files and "model.layers.3.input_layernorm.weight" in ck.files


def test_w4_weights_are_packed_eight_per_int32(quants):
    ck = Checkpoint(quants["W4A16"])
    t = _module_tensors(ck, "model.layers.1.self_attn.kv_b_proj")
    assert t["weight_packed"].dtype == torch.int32 and t["weight_packed"].shape == (512, 128 // 8)
    assert t["weight_scale"].shape == (512, 1) and t["weight_scale"].dtype == torch.bfloat16
    assert t["weight_shape"].tolist() == [512, 128]
    asym = _module_tensors(Checkpoint(quants["W4A16_ASYM"]), "model.layers.1.self_attn.kv_b_proj")
    assert asym["weight_zero_point"].dtype == torch.int32 and asym["weight_zero_point"].shape == (512 // 8, 1)


@pytest.mark.parametrize("scheme", ["W4A16", "W4A16_ASYM", "W8A16"])
def test_loader_takes_stored_words_without_repacking(quants, scheme):
    """The loader hands the checkpoint's packed words to the runtime as they are (transposed into the kernel
    layout): the same layer as unpacking to int8 and packing again, which was most of a W4A16 load."""
    ck = Checkpoint(quants[scheme])
    name = "model.layers.3.mlp.experts.0.down_proj"
    stored = _module_tensors(ck, name)
    kept, _ = ck.quantized.read_linear(name, dict(stored), keep_packed=True)
    unpacked, _ = ck.quantized.read_linear(name, dict(stored))
    assert kept.values is None and kept.packed_rows is stored["weight_packed"]
    assert torch.equal(kept.integer_values(), unpacked.values)  # compressed-tensors' own unpacking
    assert torch.equal(kept.dequantize(), unpacked.dequantize())
    fast, slow = runtime_linear(kept), runtime_linear(unpacked)
    assert isinstance(fast, PackedLinear) and fast.in_features == slow.in_features == unpacked.values.shape[1]
    assert fast.state_dict().keys() == slow.state_dict().keys()
    for key, tensor in slow.state_dict().items():
        assert torch.equal(fast.state_dict()[key], tensor), key
    x = torch.randn(5, fast.in_features)
    assert torch.equal(fast(x), slow(x))
    # A grid the kernels cannot take (group 8) still runs, from the same words, dequantized in the layer.
    finer = [None if t is None else t.repeat_interleave(16, dim=1) for t in (kept.scale, kept.zero_point)]
    coarse = type(kept)(None, *finer, kept.args, None, kept.packed_rows)
    assert isinstance(runtime_linear(coarse), QuantLinear)
    torch.testing.assert_close(runtime_linear(coarse).dequantized_weight(torch.float32),
                               slow.dequantized_weight(torch.float32), rtol=0, atol=0)


DOWN = "model.layers.3.mlp.experts.0.down_proj"
# A quantized Linear's stored tensors disagreeing with each other or with the config: (scheme, what to
# change, what the one-line error says). Each once made a traceback or a wrong-shaped layer.
INCONSISTENT = [
    ("W4A16", lambda t: t.update(weight_packed=t["weight_packed"][:, :-1]), "weight_packed must be int32 of shape"),
    ("W4A16", lambda t: t.update(weight_packed=t["weight_packed"].float()), "weight_packed must be int32"),
    ("W4A16", lambda t: t.update(weight_shape=t["weight_shape"].float()), "weight_shape must be two positive"),
    ("W4A16", lambda t: t.update(weight_shape=torch.tensor([0, 8])), "weight_shape must be two positive"),
    ("W4A16", lambda t: t.pop("weight_shape"), "weight_shape must be two positive"),
    ("W4A16", lambda t: t.update(weight_scale=t["weight_scale"][:, :-1]), "weight_scale has shape"),
    ("W4A16", lambda t: t.update(weight_scale=t["weight_scale"][:-1]), "weight_scale has shape"),
    ("W4A16", lambda t: t.pop("weight_packed"), "needs weight_scale and weight_packed"),
    ("W4A16", lambda t: t.update(weight_scale=t["weight_scale"].to(torch.int16)), "scales must be floating point"),
    ("W4A16", lambda t: t.update(weight_g_idx=torch.full((t["weight_shape"][1],), 99, dtype=torch.int32)),
     "weight_g_idx must hold"),
    ("W4A16_ASYM", lambda t: t.update(weight_zero_point=t["weight_zero_point"][:-1]),
     "packed weight_zero_point has shape"),
    ("W8A8", lambda t: t.update(weight=t["weight"][0]), "weight must be 2-D"),
    ("W8A8", lambda t: t.update(weight_zero_point=torch.zeros(3, 1, dtype=torch.int8)), "weight_zero_point has shape"),
]


def test_channel_scales_stored_flat_or_per_tensor_are_read_as_columns(quants):
    """Other writers store per-channel scales 1-D, or one scale for the whole tensor: the same grid."""
    ck = Checkpoint(quants["W8A8"])
    assert ck.quantized.groups[0]["weights"]["strategy"] == "channel"
    stored = _module_tensors(ck, DOWN)
    column, _ = ck.quantized.read_linear(DOWN, dict(stored))
    flat, _ = ck.quantized.read_linear(DOWN, dict(stored, weight_scale=stored["weight_scale"].flatten()))
    assert column.scale.shape == (column.values.shape[0], 1) and torch.equal(flat.scale, column.scale)
    single, _ = ck.quantized.read_linear(DOWN, dict(stored, weight_scale=stored["weight_scale"][0].clone()))
    assert single.scale.shape == column.scale.shape and bool((single.scale == stored["weight_scale"][0]).all())


@pytest.mark.parametrize("scheme, corrupt, expected", INCONSISTENT)
def test_inconsistent_quantized_tensors_are_refused_by_name(quants, tmp_path, capsys, scheme, corrupt, expected):
    """Through a real command: one line naming the module, the problem and the shard that holds it."""
    model = tmp_path / "model"
    shutil.copytree(quants[scheme], model)
    ck = Checkpoint(model)
    shard = ck.files[f"{DOWN}.weight_scale"]
    state = load_file(shard)
    mine = {k[len(DOWN) + 1:]: state.pop(k) for k in list(state) if k.startswith(DOWN + ".")}
    corrupt(mine)
    save_file({**state, **{f"{DOWN}.{k}": v.contiguous() for k, v in mine.items()}}, str(shard))
    index = model / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())
    weight_map["weight_map"].update({f"{DOWN}.{k}": shard.name for k in mine})
    weight_map["weight_map"] = {k: v for k, v in weight_map["weight_map"].items()
                                if not k.startswith(DOWN + ".") or k[len(DOWN) + 1:] in mine}
    index.write_text(json.dumps(weight_map))
    assert main(["generate", str(model), "--prompt", "x", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert DOWN in err and expected in err and shard.name in err, err


@pytest.mark.parametrize("weights, expected", [
    ({"num_bits": "four", "strategy": "group", "group_size": 128}, "weights.num_bits"),
    ({"num_bits": 4, "strategy": "diagonal"}, "weights.strategy"),
    ({"num_bits": 4, "strategy": "group"}, "group_size"),
    ({"num_bits": 4, "strategy": "group", "group_size": -3}, "weights.group_size"),
    ({"num_bits": 0, "strategy": "channel"}, "integers of 0 bits are not supported"),
    ({"num_bits": 16, "strategy": "channel"}, "integers of 16 bits are not supported"),
])
def test_malformed_quantization_config_is_refused_before_reading(quants, tmp_path, capsys, weights, expected):
    model = tmp_path / "model"
    shutil.copytree(quants["W4A16"], model)
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"] = weights
    (model / "config.json").write_text(json.dumps(config))
    assert main(["generate", str(model), "--prompt", "x", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "group_0" in err and expected in err and "config.json" in err, err


@pytest.mark.parametrize("scheme", ["W4A16", "W8A8"])
def test_mla_kv_b_proj_is_served_dequantized_once(quants, scheme):
    """Absorbed MLA reads kv_b_proj whole in every layer of every decode step: the loader holds it
    dequantized (in the model dtype) instead of dequantizing it per step; every other Linear stays quantized."""
    ck = Checkpoint(quants[scheme])
    layer = ck.layer(1, torch.float32)
    kv_b = layer.self_attn.kv_b_proj
    assert type(kv_b) is nn.Linear and kv_b.weight.dtype == torch.float32
    stored = _module_tensors(ck, "model.layers.1.self_attn.kv_b_proj")
    reader = ck.quantized
    quantized, activations = reader.read_linear("model.layers.1.self_attn.kv_b_proj", dict(stored))
    torch.testing.assert_close(kv_b.weight, runtime_linear(quantized, activations).dequantized_weight(torch.float32))
    others = [m for n, m in layer.named_modules() if isinstance(m, (nn.Linear, PackedLinear, QuantLinear))
              and n != "self_attn.kv_b_proj"]
    assert others and all(isinstance(m, (PackedLinear, QuantLinear)) for m in others)


def test_output_is_a_complete_checkpoint(quants):
    out = quants["W4A16"]
    for name in ("config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
                 "quantship_recipe.json"):
        assert (out / name).is_file(), name
    recipe = json.loads((out / "quantship_recipe.json").read_text())
    # RTN rounds each weight on its own: no calibration pass, so no routing counts either.
    assert recipe["scheme"] == "W4A16" and recipe["method"] == "rtn" and recipe["calibration"] == {}
    assert recipe["tokens_per_expert"] == {}
    assert recipe["quantship_version"] and recipe["seconds"] > 0
    assert not list(out.parent.glob(".*partial*"))


def test_eight_bit_schemes_are_near_lossless_on_heldout_text(quants):
    kl = {s: quick_fidelity("tiny", quants[s], max_tokens=2048)["kl_mean"] for s in quants}
    for scheme in ("W8A16", "W8A8", "FP8_DYNAMIC"):
        assert kl[scheme] < 0.01 and kl[scheme] < kl["W4A16"] / 3, kl
    assert kl["W8A16"] < kl["W8A8"]  # quantized activations cost something on top of the weights


# Asymmetric checkpoints are checked through compressed-tensors' own decompressor above: with
# compressed-tensors 0.20, transformers allocates unpacked zero points and rejects the packed ones
# that the same library's compressor (and vLLM) use.
@pytest.mark.parametrize("scheme,actorder", [("W4A16", "static"), ("W4A16", None), ("W8A16", "static")])
def test_transformers_reads_our_llama_quantization(llama_dir, tmp_path, scheme, actorder):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "q"
    quantize(llama_dir, out, QuantizeOptions(scheme=scheme, method="gptq", actorder=actorder, **FAST))
    assert not any(n.endswith("weight_g_idx") for n in Checkpoint(out).files)  # static needs no g_idx
    ours = Checkpoint(out).load_model()
    reference = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.arange(1, 200)[None]
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), reference(ids).logits, atol=2e-3, rtol=1e-3)


def test_awq_and_gptq_beat_rtn_and_8bit_beats_4bit(demo_run, quants):
    """Quality on held-out text: the issue's proof, with margins. The demo quantizes the bundled model W4A16
    (RTN, GPTQ, AWQ) and W8A16 with 64 samples of 256 tokens and measures each on 8K held-out tokens, as
    this test would: its figures are read here (its recipes say the settings), W8A8 is measured alike."""
    proc, work = demo_run
    assert proc.returncode == 0, proc.stderr
    results = {}
    for row in json.loads((work / "fidelity.json").read_text()):
        recipe = json.loads((work / row["checkpoint"] / "quantship_recipe.json").read_text())
        assert (recipe["scheme"], recipe["method"]) == (row["scheme"], row["method"])
        if recipe["method"] != "rtn":  # RTN calibrates on nothing
            assert (recipe["calibration"]["samples"], recipe["calibration"]["seq_len"]) == (64, 256), recipe
        results[(row["scheme"], row["method"])] = row
    results[("W8A8", "rtn")] = quick_fidelity("tiny", quants["W8A8"], max_tokens=8192)
    assert len({r["tokens"] for r in results.values()}) == 1  # every figure over the same held-out tokens
    rtn = results[("W4A16", "rtn")]
    for method in ("awq", "gptq"):
        r = results[("W4A16", method)]
        assert r["kl_mean"] < 0.88 * rtn["kl_mean"], (method, r, rtn)
        assert r["top1_agreement"] > rtn["top1_agreement"]
    best_w4 = min(results[("W4A16", m)]["kl_mean"] for m in ("rtn", "awq", "gptq"))
    for scheme in ("W8A16", "W8A8"):
        assert results[(scheme, "rtn")]["kl_mean"] < 0.25 * best_w4, (scheme, results[(scheme, "rtn")])


def test_starved_experts_fall_back_with_finite_scales(tmp_path):
    out = tmp_path / "q"
    recipe = quantize("tiny", out, QuantizeOptions(method="gptq", min_expert_tokens=10**9, samples=4, seq_len=128))
    assert len([f for f in recipe["fallbacks"] if ".mlp.experts." in f]) == 7 * 8 * 3
    assert set(recipe["tokens_per_expert"]) == {str(i) for i in range(1, 8)}
    assert sum(recipe["tokens_per_expert"]["1"]) == 4 * 128 * 2  # top-2: every token counted twice
    assert recipe["calibration"]["samples"] == 4
    model = Checkpoint(out).load_model()
    for module in model.modules():
        if isinstance(module, (QuantLinear, PackedLinear)):
            assert torch.isfinite(module.weight_scale).all() and (module.weight_scale > 0).all()


# --- bad input: one clear line, nothing half-written ---------------------------------------


def _fails(args, capsys, expected):
    capsys.readouterr()  # drop what the test's set-up printed
    assert main(["quantize", *args, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert expected in err and len(err.strip().splitlines()) == 1, err


def test_group_size_that_does_not_divide(tmp_path, capsys):
    model = tmp_path / "m"
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=8192, hidden_size=256, intermediate_size=320,
                                  num_hidden_layers=1, num_attention_heads=4)
    AutoModelForCausalLM.from_config(config).save_pretrained(model)
    shutil.copy(TINY_DIR / "tokenizer.json", model)
    shutil.copy(TINY_DIR / "tokenizer_config.json", model)
    _fails([str(model), "-o", str(tmp_path / "out"), "--strict-groups"], capsys,
           "does not divide model.layers.0.mlp.down_proj")
    assert not (tmp_path / "out").exists()


def test_empty_and_short_calibration(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    _fails(["-o", str(tmp_path / "o1"), "--calib", str(empty)], capsys, "calibration file is empty")
    short = tmp_path / "short.jsonl"
    short.write_text('{"text": "def f(): pass"}\n')
    _fails(["-o", str(tmp_path / "o2"), "--calib", str(short)], capsys, "fewer than one sample")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    _fails(["-o", str(tmp_path / "o3"), "--calib", str(bad)], capsys, "line 2: not JSON")
    assert not any(tmp_path.glob("o*"))


def test_actorder_group_is_not_offered(tmp_path, capsys):
    _fails(["-o", str(tmp_path / "o"), "--method", "gptq", "--actorder", "group"], capsys, "invalid choice: 'group'")
    with pytest.raises(QuantshipError, match="--actorder must be static"):
        quantize("tiny", tmp_path / "o", QuantizeOptions(method="gptq", actorder="group"))


def test_existing_output_and_already_quantized(quants, tmp_path, capsys):
    existing = tmp_path / "exists"
    existing.mkdir()
    _fails(["-o", str(existing)], capsys, "output directory exists")
    _fails([str(quants["W4A16"]), "-o", str(tmp_path / "again")], capsys, "already quantized")


def test_interrupted_run_leaves_no_checkpoint(tmp_path, monkeypatch):
    """Stopped before any layer finished: nothing is kept. (A run stopped later keeps its finished layers
    for --resume in the hidden .out.partial directory: test_resume.py.)"""

    def failing(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "_quantize_layer", failing)
    with pytest.raises(KeyboardInterrupt):
        quantize("tiny", tmp_path / "out", QuantizeOptions(**FAST))
    assert list(tmp_path.iterdir()) == []
