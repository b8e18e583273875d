"""ONNX export (quantship export --format onnx): checked by onnx.checker, run by ONNX Runtime on CPU,
compared with our model definition on the same weights."""

import hashlib
import json
import shutil

import numpy as np
import onnx
import pytest
import torch

from quantship.cli import main
from quantship.errors import QuantshipError
from quantship.formats import onnx as onnx_export
from quantship.formats.onnx import OnnxOptions, export_onnx
from quantship.formats.onnx_runtime import OnnxModel
from quantship.models.bundled import TINY_DIR
from quantship.models.loader import load_model
from quantship.models.reference_loop import generate_tokens


def window(batch=2, length=40, seed=1):
    return torch.randint(0, 8000, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def llama_fp32(llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("onnx") / "llama-fp32"
    export_onnx(llama_dir, out, OnnxOptions(type="fp32"))
    return out


@pytest.fixture(scope="module")
def tiny_fp32(tmp_path_factory):
    out = tmp_path_factory.mktemp("onnx") / "tiny-fp32"
    export_onnx(TINY_DIR, out, OnnxOptions(type="fp32"))
    return out


def test_llama_layout_checker_and_files(llama_fp32):
    onnx.checker.check_model(str(llama_fp32 / "model.onnx"), full_check=True)
    model = onnx.load(str(llama_fp32 / "model.onnx"), load_external_data=False)
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in [*model.graph.input, *model.graph.output]}
    assert dims["input_ids"] == ["batch_size", "sequence_length"]
    assert dims["attention_mask"] == ["batch_size", "total_sequence_length"]
    assert dims["position_ids"] == ["batch_size", "sequence_length"]
    assert dims["past_key_values.1.key"] == ["batch_size", 2, "past_sequence_length", 64]
    assert dims["present.1.value"] == ["batch_size", 2, "total_sequence_length", 64]
    assert dims["logits"] == ["batch_size", "sequence_length", 8192]
    assert len(model.graph.input) == 3 + 2 * 2 and len(model.graph.output) == 1 + 2 * 2
    assert {o.domain or "ai.onnx": o.version for o in model.opset_import} == {"ai.onnx": 17}
    # weights live in the external data file, none inline beyond small constants
    assert all(t.data_location == onnx.TensorProto.EXTERNAL
               for t in model.graph.initializer if t.name.endswith("weight"))
    files = {p.name for p in llama_fp32.iterdir()}
    assert {"model.onnx", "model.onnx.data", "genai_config.json", "tokenizer.json", "config.json",
            "quantship_onnx.json", "SHA256SUMS"} <= files
    for line in (llama_fp32 / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split("  ")
        assert hashlib.sha256((llama_fp32 / name).read_bytes()).hexdigest() == digest
    genai = json.loads((llama_fp32 / "genai_config.json").read_text())
    assert genai["model"]["type"] == "llama"
    assert genai["model"]["decoder"]["inputs"]["past_key_names"] == "past_key_values.%d.key"
    assert genai["model"]["decoder"]["head_size"] == 64 and genai["model"]["decoder"]["num_key_value_heads"] == 2


def test_llama_fp32_logits_and_greedy_match_our_model(llama_dir, llama_fp32):
    ours, onnx_model = load_model(llama_dir), OnnxModel(llama_fp32)
    ids = window()
    with torch.no_grad():
        expected = ours(ids).numpy()
    np.testing.assert_allclose(onnx_model.logits(ids.numpy()), expected, atol=1e-4, rtol=0)
    prompt = ids[0, :8].tolist()
    assert onnx_model.greedy(prompt, 32) == list(generate_tokens(ours, prompt, 32))


def test_llama_cache_and_padding(llama_fp32):
    """Prefill in two chunks through the cache equals one pass; a left-padded row equals the row alone."""
    m = OnnxModel(llama_fp32)
    ids = window(1, 24).numpy()
    whole = m.logits(ids)
    first, cache = m.step(ids[:, :10], m.empty_cache(), 0)
    second, _ = m.step(ids[:, 10:], cache, 10)
    np.testing.assert_allclose(np.concatenate([first, second], axis=1), whole, atol=1e-4, rtol=0)
    short = window(1, 16, seed=2).numpy()
    padded = np.concatenate([np.zeros((1, 8), dtype=np.int64), short], axis=1)
    batch = np.concatenate([padded, ids], axis=0)
    mask = np.ones_like(batch)
    mask[0, :8] = 0
    positions = np.stack([np.maximum(np.arange(24) - 8, 0), np.arange(24)])
    feeds = {"input_ids": batch, "attention_mask": mask, "position_ids": positions, **m.empty_cache(2)}
    logits = m.session.run(["logits"], feeds)[0]
    np.testing.assert_allclose(logits[0, 8:], m.logits(short)[0], atol=1e-4, rtol=0)
    np.testing.assert_allclose(logits[1], whole[0], atol=1e-4, rtol=0)


def test_llama_fp16(llama_dir, tmp_path):
    export_onnx(llama_dir, tmp_path / "fp16", OnnxOptions(type="fp16"))
    m = OnnxModel(tmp_path / "fp16")
    assert m.cache_dtype == np.float16
    weights = onnx.load(str(tmp_path / "fp16" / "model.onnx"), load_external_data=False).graph.initializer
    assert {t.data_type for t in weights if t.name.endswith("proj.weight")} == {onnx.TensorProto.FLOAT16}
    ours = load_model(llama_dir)
    ids = window()
    with torch.no_grad():
        expected = ours(ids).numpy()
    np.testing.assert_allclose(m.logits(ids.numpy()), expected, atol=1e-2, rtol=0)
    prompt = ids[0, :8].tolist()
    assert m.greedy(prompt, 32) == list(generate_tokens(ours, prompt, 32))


def test_deepseek_v3_mla_moe_matches_our_model(tiny_fp32):
    """The bundled DeepSeek-V3-shaped model: MLA with the latent cached, MoE routed inside the graph."""
    m = OnnxModel(tiny_fp32)
    names = [i.name for i in m.session.get_inputs()]
    assert "past_key_values.0.latent" in names and not any(n.endswith(".key") for n in names)
    assert m.session.get_inputs()[3].shape == ["batch_size", 1, "past_sequence_length", 128 + 16]
    graph = onnx.load(str(tiny_fp32 / "model.onnx"), load_external_data=False).graph
    assert {"TopK", "GatherElements", "ScatterND", "ScatterElements", "NonZero"} <= {n.op_type for n in graph.node}
    ours = load_model(TINY_DIR)
    ids = window()
    with torch.no_grad():
        expected = ours(ids).numpy()
    np.testing.assert_allclose(m.logits(ids.numpy()), expected, atol=2e-4, rtol=0)
    prompt = ids[0, :8].tolist()
    assert m.greedy(prompt, 32) == list(generate_tokens(ours, prompt, 32))


def test_cli_export_onnx(llama_dir, tmp_path, capsys):
    assert main(["export", str(llama_dir), "--format", "onnx", "-o", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "ONNX fp32 (LlamaForCausalLM)" in out and "onnx.checker full check passed" in out
    assert (tmp_path / "out" / "model.onnx").is_file()


def test_bad_input_is_one_line_and_leaves_nothing(llama_dir, tmp_path, capsys, monkeypatch):
    def run(*args):
        code = main(["export", *map(str, args)])
        return code, capsys.readouterr().err.strip()

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    (tmp_path / "file").write_text("x")
    for args, words in [([llama_dir, "--format", "onnx", "-o", tmp_path / "full"], "not empty"),
                        ([llama_dir, "--format", "onnx", "-o", tmp_path / "file"], "not a directory"),
                        ([llama_dir, "--format", "onnx", "-o", tmp_path / "a", "--type", "int3"], "unknown ONNX type"),
                        ([tmp_path / "full", "--format", "onnx", "-o", tmp_path / "b"], "no config.json"),
                        ([llama_dir, "--format", "onnx", "-o", tmp_path / "c", "--method", "gptq"], "--method")]:
        code, err = run(*args)
        assert code == 2 and words in err and len(err.splitlines()) == 1, err
    # a failure halfway through the layers removes the partial directory
    monkeypatch.setattr(onnx_export, "build_decoder",
                        lambda *a: (_ for _ in ()).throw(QuantshipError("boom")))
    code, err = run(llama_dir, "--format", "onnx", "-o", tmp_path / "d")
    assert code == 2 and "boom" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "full"]


# --- int4: MatMulNBits from the checkpoint's integers -------------------------------------------

FAST = dict(samples=8, seq_len=128)


def nbits_dequantized(export_dir, node_name: str) -> np.ndarray:
    """Run one exported MatMulNBits node alone on the identity matrix: its weight [K, N] as ORT sees it."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(export_dir / "model.onnx"))
    node = next(n for n in model.graph.node if n.name == node_name)
    inits = {t.name: t for t in model.graph.initializer}
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    k, n = attrs["K"], attrs["N"]
    tensors = [numpy_helper.from_array(numpy_helper.to_array(inits[name]), f"w{i}")
               for i, name in enumerate(node.input[1:])]
    single = helper.make_node("MatMulNBits", ["A", *(t.name for t in tensors)], ["Y"], domain="com.microsoft", **attrs)
    graph = helper.make_graph([single], "one", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [k, k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [k, n])], tensors)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                          ir_version=8)
    session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"A": np.eye(k, dtype=np.float32)})[0]


def kl_mean(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    p, q = torch.from_numpy(p_logits).log_softmax(-1), torch.from_numpy(q_logits).log_softmax(-1)
    return float((p.exp() * (p - q)).sum(-1).mean())


@pytest.mark.parametrize("scheme,method,group", [("W4A16", "awq", 128), ("W4A16", "gptq", 64),
                                                 ("W4A16_ASYM", "rtn", 32)])
def test_int4_matmulnbits_bit_exact_with_checkpoint(llama_dir, tmp_path, scheme, method, group):
    from quantship.formats.onnx_weights import read_layer
    from quantship.models.loader import Checkpoint
    from quantship.quant.pipeline import QuantizeOptions, quantize

    quantize(llama_dir, tmp_path / "q", QuantizeOptions(scheme=scheme, method=method, group_size=group, **FAST))
    result = export_onnx(tmp_path / "q", tmp_path / "onnx", OnnxOptions(type="int4"))
    assert result.linears == {"int4 from the checkpoint's integers": 14}
    graph = onnx.load(str(tmp_path / "onnx" / "model.onnx"), load_external_data=False).graph
    nodes = [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert len(nodes) == 14 and not [n for n in graph.node if n.op_type == "MatMul" and "proj" in n.name]
    assert all(n.domain == "com.microsoft" for n in nodes)
    assert {a.i for n in nodes for a in n.attribute if a.name == "block_size"} == {group}
    assert all(("zero_points" in "".join(n.input) or n.input[-1].endswith("_zp")) == (scheme == "W4A16_ASYM")
               for n in nodes)
    ck = Checkpoint(tmp_path / "q")
    for layer in range(2):
        _, stored = read_layer(ck, layer)
        for module, q in stored.items():
            part = module.split(".")[0] + "/" + module.split(".")[1]
            got = nbits_dequantized(tmp_path / "onnx", f"/model/layers.{layer}/{part}/MatMulNBits")
            assert np.array_equal(got, q.dequantize().t().numpy()), module  # bit for bit
    # the whole graph against our model running the same checkpoint
    ours, m = load_model(tmp_path / "q"), OnnxModel(tmp_path / "onnx")
    ids = window()
    with torch.no_grad():
        expected = ours(ids).float().numpy()
    assert kl_mean(expected, m.logits(ids.numpy())) < 1e-6
    prompt = ids[0, :8].tolist()
    assert m.greedy(prompt, 32) == list(generate_tokens(ours, prompt, 32))


def test_int4_refuses_other_grids(llama_dir, tmp_path, capsys):
    from quantship.quant.pipeline import QuantizeOptions, quantize

    quantize(llama_dir, tmp_path / "q", QuantizeOptions(scheme="W8A16", **FAST))
    code = main(["export", str(tmp_path / "q"), "--format", "onnx", "-o", str(tmp_path / "o"), "--type", "int4"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "int4 export takes W4A16" in err and "8-bit" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["q"]


def test_int4_from_full_precision_deepseek(tmp_path, tiny_fp32):
    """RTN int4 of the bundled V3 model (experts included) in MatMulNBits: close to fp32, bit-exact to RTN."""
    from quantship.models.loader import Checkpoint
    from quantship.quant.rtn import rtn_quantize
    from quantship.quantized_tensor import WeightQuant

    result = export_onnx(TINY_DIR, tmp_path / "int4", OnnxOptions(type="int4"))
    assert result.linears == {"int4 RTN group 128": 232}
    weight = Checkpoint(TINY_DIR).layer_state(1)["mlp.experts.3.down_proj.weight"]
    expected = rtn_quantize(weight, WeightQuant(4, "int", True, "group", 128)).dequantize()
    got = nbits_dequantized(tmp_path / "int4", "/model/layers.1/mlp/experts.3/down_proj/MatMulNBits")
    assert np.array_equal(got, expected.t().numpy())
    ours = load_model(TINY_DIR)  # the same RTN applied to our model's Linears
    for layer in ours.model.layers:
        for module in layer.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(rtn_quantize(module.weight, WeightQuant(4, "int", True, "group", 128)).dequantize())
    ids = window(1, 64)
    with torch.no_grad():
        expected = ours(ids).numpy()
    got = OnnxModel(tmp_path / "int4").logits(ids.numpy())
    assert kl_mean(expected, got) < 1e-6
    assert kl_mean(OnnxModel(tiny_fp32).logits(ids.numpy()), got) > 1e-3  # and int4 is not fp32
    assert (tmp_path / "int4" / "model.onnx.data").stat().st_size < 0.5 * (tiny_fp32 / "model.onnx.data").stat().st_size


# --- int8: QDQ, dynamic per token and static from calibration ------------------------------------

def test_int8_dynamic_equals_our_w8a8(llama_dir, tmp_path):
    """A W8A8 checkpoint (int8 weights per channel, int8 activations per token) runs the same in ONNX Runtime."""
    from quantship.quant.pipeline import QuantizeOptions, quantize

    quantize(llama_dir, tmp_path / "q", QuantizeOptions(scheme="W8A8", **FAST))
    result = export_onnx(tmp_path / "q", tmp_path / "onnx", OnnxOptions(type="int8-dynamic"))
    assert result.linears == {"int8 from the checkpoint's integers": 14}
    graph = onnx.load(str(tmp_path / "onnx" / "model.onnx"), load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("QuantizeLinear") == 14 and ops.count("DequantizeLinear") == 28
    assert {t.data_type for t in graph.initializer if t.name.endswith("weight_quantized")} == {onnx.TensorProto.INT8}
    ours = load_model(tmp_path / "q")
    ids = window()
    with torch.no_grad():
        expected = ours(ids).float().numpy()
    # ONNX Runtime's extended optimizations fuse DequantizeLinear + MatMul into an 8-bit MatMulNBits that
    # computes with int8 activations per block by default (accuracy level 4): a little extra rounding.
    m = OnnxModel(tmp_path / "onnx")
    assert kl_mean(expected, m.logits(ids.numpy())) < 1e-4
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    m.session = ort.InferenceSession(str(tmp_path / "onnx" / "model.onnx"), options, providers=["CPUExecutionProvider"])
    assert kl_mean(expected, m.logits(ids.numpy())) < 5e-6  # float compute: only per-token rounding ties differ
    with pytest.raises(QuantshipError, match="already quantized"):
        export_onnx(tmp_path / "q", tmp_path / "static", OnnxOptions(type="int8-static"))


def test_int8_static_scales_equal_onnxruntime_quantize_static(llama_dir, llama_fp32, tmp_path):
    """Same calibration windows: our activation scales and zero points are quantize_static's (MinMax, QInt8,
    QDQ), and both int8 graphs stay close to fp32."""
    from onnx import numpy_helper
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    from quantship.formats.onnx_calibrate import calibration_windows
    from quantship.models.loader import Checkpoint

    result = export_onnx(llama_dir, tmp_path / "ours", OnnxOptions(type="int8-static", samples=16, seq_len=128))
    assert result.calibration["samples"] == 16 and result.calibration["fallbacks"] == []
    fp32 = OnnxModel(llama_fp32)
    tokens, _ = calibration_windows(Checkpoint(llama_dir), None, 16, 128)

    class Windows(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter({"input_ids": w[None].numpy(), "attention_mask": np.ones((1, 128), np.int64),
                               "position_ids": np.arange(128)[None], **fp32.empty_cache(1)} for w in tokens)

        def get_next(self):
            return next(self.feeds, None)

    graph = onnx.load(str(llama_fp32 / "model.onnx"), load_external_data=False).graph
    linears = [n for n in graph.node if n.op_type == "MatMul" and n.name.endswith("_proj/MatMul")]
    (tmp_path / "ort").mkdir()
    quantize_static(str(llama_fp32 / "model.onnx"), str(tmp_path / "ort" / "model.onnx"), Windows(),
                    quant_format=QuantFormat.QDQ, nodes_to_quantize=[n.name for n in linears], per_channel=True,
                    op_types_to_quantize=["MatMul"], activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                    use_external_data_format=True)
    theirs_model, ours_model = (onnx.load(str(tmp_path / side / "model.onnx")) for side in ("ort", "ours"))
    theirs = {t.name: numpy_helper.to_array(t) for t in theirs_model.graph.initializer}
    ours = {t.name: numpy_helper.to_array(t) for t in ours_model.graph.initializer}
    our_nodes = {n.name: n for n in ours_model.graph.node}
    assert len(linears) == 14
    for node in linears:
        q = our_nodes[node.name.replace("/MatMul", "/input_QuantizeLinear")]
        np.testing.assert_allclose(ours[q.input[1]], theirs[node.input[0] + "_scale"], rtol=1e-5)
        assert ours[q.input[2]] == theirs[node.input[0] + "_zero_point"]
    ids = window(2, 64).numpy()
    reference = fp32.logits(ids)
    kl_ours = kl_mean(reference, OnnxModel(tmp_path / "ours").logits(ids))
    import onnxruntime as ort

    session = ort.InferenceSession(str(tmp_path / "ort" / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.tile(np.arange(64), (2, 1)),
             **fp32.empty_cache(2)}
    kl_theirs = kl_mean(reference, session.run(["logits"], feeds)[0])
    assert 0 < kl_ours < 1e-3 and 0 < kl_theirs < 1e-3 and kl_ours < 3 * kl_theirs, (kl_ours, kl_theirs)


def test_int8_static_deepseek_experts_without_tokens(tmp_path, tiny_fp32):
    """Experts no calibration token reached get a range (MoE input / widest down_proj), never NaN."""
    result = export_onnx(TINY_DIR, tmp_path / "s", OnnxOptions(type="int8-static", samples=1, seq_len=2))
    assert result.linears == {"int8 RTN per channel": 232}
    info = json.loads((tmp_path / "s" / "quantship_onnx.json").read_text())
    assert info["calibration"]["fallbacks"], "2 tokens reach at most 4 of 8 experts"
    assert all("experts." in name for name in info["calibration"]["fallbacks"])
    ids = window(1, 48).numpy()
    got = OnnxModel(tmp_path / "s").logits(ids)
    # two calibration tokens clip a lot: this checks the graph is sane, not that the scales are good
    assert np.isfinite(got).all() and kl_mean(OnnxModel(tiny_fp32).logits(ids), got) < 1.0
    from quantship.formats.onnx_calibrate import calibrate_ranges
    from quantship.models.loader import Checkpoint

    ranges, calib = calibrate_ranges(Checkpoint(TINY_DIR), None, 1, 2)
    for name in calib["fallbacks"]:
        layer = name.split(".mlp.")[0]
        if not name.endswith("down_proj"):
            assert ranges[name] == ranges[f"{layer}.mlp.shared_experts.gate_proj"]


def test_info_describes_an_export_from_its_own_files(llama_fp32, tmp_path, capsys):
    assert main(["info", str(llama_fp32), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    graph = onnx.load(str(llama_fp32 / "model.onnx"), load_external_data=False).graph
    written = json.loads((llama_fp32 / "quantship_onnx.json").read_text())
    assert info["format"] == "onnx" and info["type"] == "fp32" and info["architecture"] == "LlamaForCausalLM"
    assert info["nodes"] == len(graph.node) and sum(info["operators"].values()) == len(graph.node)
    assert info["linears"] == written["linears"] and info["layers"] == 2
    assert info["size_bytes"] == sum(f.stat().st_size for f in llama_fp32.iterdir())
    assert main(["info", str(llama_fp32)]) == 0
    assert "ONNX export, type fp32" in capsys.readouterr().out
    broken = tmp_path / "broken"
    shutil.copytree(llama_fp32, broken)
    for name, text, expected in (("quantship_onnx.json", '{"linears": 5}', "linears must be a JSON object"),
                                 ("model.onnx", "not a protobuf", "unreadable ONNX export")):
        (broken / name).write_text(text)
        assert main(["info", str(broken)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and expected in err, err


def test_verify_takes_an_onnx_export_as_quant(llama_dir, llama_fp32):
    """verify runs QUANT through ONNX Runtime: the fp32 export is measured as lossless, generations agree."""
    from quantship.verify.run import VerifyOptions, verify

    report = verify(llama_dir, llama_fp32, VerifyOptions(ctx=64, max_tokens=256, max_new_tokens=16, bootstrap=50))
    assert report["quant_scheme"] == "ONNX fp32"
    assert report["headline"]["kl_mean"] < 1e-6 and report["headline"]["top1_agreement"] == 1.0
    assert "sensitivity" not in report  # per-layer swaps need our modules; the graph runs whole
    assert all(g["tokens_to_divergence"] is None for g in report["generations"])


# --- the R1-Distill-Qwen architectures -----------------------------------------------------------

@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_qwen_fp32_and_int4_match_our_model(reference_dirs, tmp_path, name):
    """Qwen2 (q/k/v biases, untied head) and Qwen3 (per-head q/k norms, head_dim apart from hidden/heads,
    tied embeddings): ONNX Runtime's logits equal our model's, its cache gives our greedy tokens, and
    int4 from a W4A16 checkpoint stays near the checkpoint's own dequantized model."""
    from quantship.quant.pipeline import QuantizeOptions, quantize

    source = reference_dirs[name][0]
    out = tmp_path / "fp32"
    result = export_onnx(source, out, OnnxOptions(type="fp32"))
    assert result.architecture == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[name]
    assert json.loads((out / "genai_config.json").read_text())["model"]["type"] == name
    ours, onnx_model = load_model(source), OnnxModel(out)
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ours(ids).numpy()
    np.testing.assert_allclose(onnx_model.logits(ids.numpy()), expected, atol=1e-4, rtol=0)
    prompt = ids[0, :8].tolist()
    assert onnx_model.greedy(prompt, 32) == list(generate_tokens(ours, prompt, 32))
    import shutil

    from tokenizer_families import write_tokenizer

    shutil.copytree(source, tmp_path / "src")  # quantize wants a tokenizer; the reference models have none
    write_tokenizer("qwen2", tmp_path / "src", vocab_size=500)
    quantize(tmp_path / "src", tmp_path / "w4",
             QuantizeOptions(scheme="W4A16", method="rtn", group_size=32, seq_len=64))
    export_onnx(tmp_path / "w4", tmp_path / "int4", OnnxOptions(type="int4"))
    with torch.no_grad():
        dequantized = load_model(tmp_path / "w4")(ids).numpy()
    assert kl_mean(dequantized, OnnxModel(tmp_path / "int4").logits(ids.numpy())) < 1e-4


# --- deploy: an ONNX Runtime server pod (Triton's onnxruntime backend) ----------------------------

def test_deploy_writes_a_triton_pod_for_an_onnx_export(llama_fp32, tmp_path, capsys):
    import yaml

    from quantship.deploy.checksums import verify
    from quantship.deploy.generate import DeployOptions, generate
    from quantship.deploy.validate import validate_dir

    result = generate(llama_fp32, tmp_path / "k8s", DeployOptions(replicas="2:4"))
    assert result["checkpoint"]["format"] == "onnx/fp32" and result["plan"]["engine"] == "triton-onnxruntime"
    assert validate_dir(tmp_path / "k8s").problems == []
    assert verify(llama_fp32, tmp_path / "k8s").ok  # SHA256SUMS of the export, format and writer version
    deployment = yaml.safe_load((tmp_path / "k8s/base/deployment.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] == 2 and pod["containers"][0]["command"] == ["tritonserver"]
    assert pod["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert not (tmp_path / "k8s/canary").exists() and not (tmp_path / "k8s/base/hpa.yaml").exists()
    pbtxt = yaml.safe_load((tmp_path / "k8s/base/configmap.yaml").read_text())["data"]["config.pbtxt"]
    graph = onnx.load(str(llama_fp32 / "model.onnx"), load_external_data=False).graph
    for value in [*graph.input, *graph.output]:
        assert f'name: "{value.name}"' in pbtxt
    assert 'backend: "onnxruntime"' in pbtxt and "max_batch_size: 0" in pbtxt and "KIND_CPU" in pbtxt
    assert 'name: "past_key_values.0.key" data_type: TYPE_FP32 dims: [ -1, 2, -1, 64 ]' in pbtxt
    gpu = generate(llama_fp32, tmp_path / "gpu", DeployOptions(gpus=1))
    assert gpu["plan"]["gpus"] == 1 and validate_dir(tmp_path / "gpu").problems == []
    assert "KIND_GPU" in (tmp_path / "gpu/base/configmap.yaml").read_text()
    # what cannot be done is refused in one line, nothing written
    for args, words in [(["--canary"], "--canary is not available for an ONNX export"),
                        (["--engine", "vllm"], "--engine does not apply to an ONNX export"),
                        (["--gpus", "2"], "is 0 or 1")]:
        code = main(["deploy", str(llama_fp32), "-o", str(tmp_path / "x"), *args])
        err = capsys.readouterr().err.strip()
        assert code == 2 and words in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "x").exists()
    tampered = tmp_path / "tampered"
    import shutil

    shutil.copytree(llama_fp32, tampered)
    (tampered / "tokenizer.json").write_text("{}")
    code = main(["deploy", str(tampered), "-o", str(tmp_path / "y")])
    assert code == 2 and "tokenizer.json does not match the export's SHA256SUMS" in capsys.readouterr().err
