"""GGUF export: block layouts against gguf-py's reader, llama.cpp's type mix, lossless mapping of our
integers, the files as gguf-py and transformers read them, verify on a GGUF, bad input."""

import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T, quants

from quantship.cli import main
from quantship.errors import QuantshipError
from quantship.formats import gguf_blocks as B
from quantship.formats.gguf import GGUFOptions, export_gguf, summary_lines
from quantship.formats.gguf_mix import ModelShape, choose_types
from quantship.formats.gguf_read import GGUFCheckpoint
from quantship.models.loader import Checkpoint
from quantship.quant.pipeline import QuantizeOptions, quantize
from quantship.verify.compare import quick_fidelity

FAST = dict(samples=8, seq_len=128)


# --- block layouts ------------------------------------------------------------------------------

def test_our_integers_pack_into_blocks_that_gguf_dequantizes_bit_for_bit():
    torch.manual_seed(0)
    scale = (torch.rand(6, 4) * 0.02 + 1e-3).to(torch.bfloat16)
    expand = scale.float().repeat_interleave(32, dim=1)
    q4 = torch.randint(-8, 8, (6, 128), dtype=torch.int8)
    # Q4_1 stores the offset -s(8 + z) in f16: exact when 8 + z is a power of two (the common z = 0 is)
    zero = torch.tensor([-7, -6, -4, 0], dtype=torch.int8)[torch.randint(0, 4, (6, 4))]
    q8 = torch.randint(-128, 128, (6, 128)).to(torch.int8)
    cases = [(B.pack_q4_0(q4, scale), T.Q4_0, q4.float() * expand),
             (B.pack_q4_1(q4, scale, zero), T.Q4_1, (q4.float() - zero.float().repeat_interleave(32, 1)) * expand),
             (B.pack_q8_0(q8, scale), T.Q8_0, q8.float() * expand)]
    for data, qtype, expected in cases:
        assert data.shape == (6, 4 * gguf.GGML_QUANT_SIZES[qtype][1])
        assert torch.equal(torch.from_numpy(quants.dequantize(data, qtype)), expected), qtype.name


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K])
def test_k_quant_blocks_read_back_as_the_grid_we_chose(qtype):
    torch.manual_seed(1)
    w = torch.randn(4, 512) * 0.03
    params = B.k_quant_params(w.reshape(-1, 256), qtype)
    codes = B.k_quant_codes(w.reshape(-1, 256), params, qtype)
    data = B.pack_k(codes, params, qtype).reshape(4, -1)
    assert data.shape == (4, 2 * gguf.GGML_QUANT_SIZES[qtype][1])
    ours = B.k_quant_values(codes, params, qtype).reshape(4, 512)
    assert torch.equal(torch.from_numpy(quants.dequantize(data, qtype)), ours)


def test_k_quants_rank_by_bits_and_q4_k_beats_q4_0():
    torch.manual_seed(2)
    w = torch.randn(64, 1024) * 0.02

    def err(qtype):
        return float((B.dequantize(B.quantize(w, qtype), qtype) - w).norm() / w.norm())

    e = {q: err(q) for q in (T.Q4_0, T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0)}
    assert e[T.Q8_0] < e[T.Q6_K] < e[T.Q5_K] < e[T.Q4_K] < e[T.Q4_0] < 0.12


# --- llama.cpp's type mix -----------------------------------------------------------------------

def _llama_names(layers: int, cols: int = 4096) -> dict[str, tuple[int, int]]:
    names = {"token_embd.weight": (cols, 2), "output_norm.weight": (cols, 1), "output.weight": (cols, 2)}
    for i in range(layers):
        for t in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            names[f"blk.{i}.{t}.weight"] = (cols, 2)
        names[f"blk.{i}.attn_norm.weight"] = (cols, 1)
    return names


def test_q4_k_m_gives_q6_k_to_attn_v_and_ffn_down_where_llama_cpp_does():
    shape = ModelShape("llama", 32, 0, 32, 8)
    chosen = choose_types(_llama_names(32), "Q4_K_M", shape)
    # use_more_bits(i, 32): the first and last eighth, and every third layer from 4 on (6, 9, ...)
    more = {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31}
    for i in range(32):
        want = T.Q6_K if i in more else T.Q4_K
        assert chosen[f"blk.{i}.attn_v.weight"].qtype == want
        assert chosen[f"blk.{i}.ffn_down.weight"].qtype == want
        assert chosen[f"blk.{i}.attn_q.weight"].qtype == T.Q4_K
        assert f"blk.{i}.attn_norm.weight" not in chosen  # norms stay F32
    assert chosen["output.weight"].qtype == T.Q6_K and chosen["token_embd.weight"].qtype == T.Q4_K
    q4_0 = choose_types(_llama_names(32), "Q4_0", shape)
    assert q4_0["output.weight"].qtype == T.Q6_K and q4_0["blk.3.ffn_down.weight"].qtype == T.Q4_0


def test_eight_experts_and_short_rows_follow_llama_cpp():
    names = {"token_embd.weight": (384, 2), "output.weight": (384, 2), "blk.0.attn_output.weight": (256, 2),
             "blk.0.attn_k_b.weight": (32, 3), "blk.0.ffn_down_exps.weight": (128, 3),
             "blk.0.ffn_gate_inp.weight": (384, 2), "blk.1.ffn_down_exps.weight": (128, 3)}
    chosen = choose_types(names, "Q4_K_M", ModelShape("deepseek2", 8, 8, 8, 1))
    assert chosen["blk.0.attn_output.weight"].qtype == T.Q5_K  # 8 experts: attn_output one step up
    assert chosen["blk.0.attn_k_b.weight"].qtype == T.Q5_0  # 32 columns: Q4_K's fallback
    assert chosen["blk.0.attn_k_b.weight"].fallback_from == T.Q4_K
    assert chosen["blk.0.ffn_down_exps.weight"].qtype == T.Q8_0  # layer 0 wants Q6_K, 128 columns: Q8_0
    assert chosen["blk.1.ffn_down_exps.weight"].qtype == T.Q5_0  # layer 1 is not a more-bits layer
    assert chosen["output.weight"].qtype == T.Q8_0  # 384 columns do not divide by 256
    assert "blk.0.ffn_gate_inp.weight" not in chosen  # the router is never quantized


# --- lossless export from quantship's integers --------------------------------------------------

@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory):
    """The bundled DeepSeek-V3 (MLA + MoE) as W4A16 symmetric group 32, and its Q4_0 export."""
    root = tmp_path_factory.mktemp("gguf_tiny")
    quantize("tiny", root / "w4g32", QuantizeOptions(scheme="W4A16", group_size=32, **FAST))
    result = export_gguf(root / "w4g32", root / "tiny-q4_0.gguf", GGUFOptions())
    return root / "w4g32", result


def _weights(model) -> dict[str, torch.Tensor]:
    """Every weight as the forward uses it: quantized Linears dequantized, everything else as held."""
    out = {f"{n}.weight": m.dequantized_weight(torch.float32) for n, m in model.named_modules()
           if hasattr(m, "dequantized_weight")}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name.rsplit(".", 1)[0] + ".weight" not in out or name.endswith("bias"):
            out.setdefault(name, t.float())
    return out


def _assert_same_weights(ck: Checkpoint, gguf_path):
    """Every weight of the GGUF file, mapped back to our names, equals the checkpoint's dequantized one."""
    ours, theirs = _weights(ck.load_model()), _weights(GGUFCheckpoint(gguf_path).load_model())
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_info_describes_a_gguf_file_from_its_metadata(tiny_q4, tmp_path, capsys):
    _, result = tiny_q4
    assert main(["info", str(result.path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    reader = gguf.GGUFReader(result.path)
    assert info["format"] == "gguf" and info["file_type"] == "Q4_0" and info["gguf_architecture"] == "deepseek2"
    assert info["architecture"] == "DeepseekV3ForCausalLM" and info["layers"] == 8
    assert info["parameters"] == sum(int(np.prod(t.shape)) for t in reader.tensors)
    assert sum(info["tensor_types"].values()) == len(reader.tensors) and info["tensor_types"]["Q4_0"] > 0
    assert 4.5 <= info["bits_per_weight"] < 16  # Q4_0 is 4.5 bits; the file keeps norms (and more) wider
    assert info["tokenizer"]["model"] == "gpt2" and info["size_bytes"] == result.path.stat().st_size
    assert main(["info", str(result.path)]) == 0
    assert "GGUF, file type Q4_0" in capsys.readouterr().out
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(result.path.read_bytes()[:1000])
    assert main(["info", str(broken)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "broken.gguf: unreadable GGUF file" in err


def test_w4a16_g32_exports_to_q4_0_bit_for_bit(tiny_q4):
    source, result = tiny_q4
    assert result.file_type == "Q4_0" and result.arch == "deepseek2"
    mapped = [p for p in result.tensors if p.how in ("packed", "exact")]
    # per layer 6 attention tensors (kv_b split in two), then 3 dense MLP tensors (layer 0) or
    # 3 stacked expert tensors + 3 shared-expert tensors (layers 1-7)
    assert len(mapped) == 8 * 6 + 3 + 7 * 6
    assert all(result.errors[p.spec.name] == 0.0 for p in mapped)
    _assert_same_weights(Checkpoint(source), result.path)
    text = "\n".join(summary_lines(result))
    assert f"lossless: {len(mapped)} of {len(mapped)}" in text and "llama-server -m" in text


def test_gguf_reader_sees_types_shapes_and_metadata(tiny_q4):
    _, result = tiny_q4
    reader = gguf.GGUFReader(result.path)
    tensors = {t.name: t for t in reader.tensors}
    types = {n: t.tensor_type for n, t in tensors.items()}
    # MLA: kv_b split into k_b (transposed, exact F16) and v_b; experts stacked; router and bias in F32
    assert types["blk.1.attn_k_b.weight"] == T.F16 and list(tensors["blk.1.attn_k_b.weight"].shape) == [32, 128, 8]
    assert types["blk.1.attn_v_b.weight"] == T.Q4_0 and list(tensors["blk.1.attn_v_b.weight"].shape) == [128, 32, 8]
    assert list(tensors["blk.1.ffn_down_exps.weight"].shape) == [128, 384, 8]
    assert types["blk.1.ffn_gate_exps.weight"] == types["blk.1.ffn_up_shexp.weight"] == T.Q4_0
    assert types["blk.1.ffn_gate_inp.weight"] == types["blk.1.exp_probs_b.bias"] == T.F32
    assert types["token_embd.weight"] == types["output.weight"] == T.BF16  # the checkpoint kept them bf16
    assert types["blk.0.ffn_down.weight"] == T.Q4_0 and "blk.0.ffn_down_exps.weight" not in tensors
    assert types["blk.0.attn_norm.weight"] == types["blk.0.attn_kv_a_norm.weight"] == T.F32
    g = GGUFCheckpoint(result.path)
    f = g.fields
    assert f["general.architecture"] == "deepseek2" and f["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_0
    assert f["deepseek2.attention.kv_lora_rank"] == 128 and f["deepseek2.attention.key_length"] == 144
    assert f["deepseek2.attention.key_length_mla"] == 48 and f["deepseek2.attention.value_length_mla"] == 32
    assert f["deepseek2.expert_count"] == 8 and f["deepseek2.expert_used_count"] == 2
    assert f["deepseek2.expert_gating_func"] == gguf.ExpertGatingFuncType.SIGMOID
    assert f["deepseek2.expert_group_count"] == 4 and f["deepseek2.expert_weights_scale"] == pytest.approx(2.5)
    assert f["deepseek2.leading_dense_block_count"] == 1 and f["deepseek2.rope.scaling.type"] == "yarn"
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == "gpt-2"
    assert f["tokenizer.ggml.bos_token_id"] == 0 and f["tokenizer.ggml.eos_token_id"] == 1
    assert "<｜Assistant｜>" in f["tokenizer.chat_template"]
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == 8192 and bytes(tokens.parts[tokens.data[3]]).decode() == "<｜Assistant｜>"
    token_types = reader.fields["tokenizer.ggml.token_type"]
    assert token_types.parts[token_types.data[0]][0] == gguf.TokenType.CONTROL
    assert token_types.parts[token_types.data[100]][0] == gguf.TokenType.NORMAL
    assert len(reader.fields["tokenizer.ggml.merges"].data) == 7931
    # the config read back from the metadata is the model's own
    base = Checkpoint(tiny_q4[0]).config
    for key in ("architecture", "hidden_size", "kv_lora_rank", "q_lora_rank", "n_group", "topk_method",
                "scoring_func", "first_k_dense_replace", "norm_topk_prob", "rms_norm_eps", "rope"):
        assert getattr(g.config, key) == getattr(base, key), key


def test_verify_reads_a_gguf_as_quant(tiny_q4):
    source, result = tiny_q4
    from_checkpoint = quick_fidelity("tiny", source, max_tokens=1024)
    from_file = quick_fidelity("tiny", result.path, max_tokens=1024)
    assert from_file == from_checkpoint  # lossless: the same numbers to the last bit
    from quantship.verify.run import VerifyOptions, verify

    report = verify("tiny", result.path, VerifyOptions(ctx=256, max_tokens=512, sensitivity=False,
                                                       generations=False, gates="default", bootstrap=50))
    assert report["quant_scheme"] == "GGUF Q4_0" and report["gates"]["file"].endswith("W4A16.yaml")
    assert 0 < report["headline"]["kl_mean"] < 0.2


@pytest.mark.parametrize("scheme,method,qtype", [("W4A16", "gptq", T.Q4_0), ("W4A16_ASYM", "rtn", T.Q4_1),
                                                  ("W8A16", "rtn", T.Q8_0)])
def test_llama_checkpoints_map_onto_their_block_types(llama_dir, tmp_path, scheme, method, qtype):
    quantize(llama_dir, tmp_path / "q", QuantizeOptions(scheme=scheme, method=method, group_size=32, **FAST))
    result = export_gguf(tmp_path / "q", tmp_path / "q.gguf", GGUFOptions())
    assert result.file_type == qtype.name and result.arch == "llama"
    packed = [p for p in result.tensors if p.how == "packed"]
    assert len(packed) == 2 * 7 and all(p.qtype == qtype for p in packed)
    if qtype != T.Q4_1:  # Q4_1 stores the offset -s(8 + z) in f16, which can round; measured, not assumed
        assert all(result.errors[p.spec.name] == 0.0 for p in packed)
        _assert_same_weights(Checkpoint(tmp_path / "q"), result.path)
    else:
        assert max(result.errors[p.spec.name] for p in packed) < 1e-3


def test_q4_k_m_from_full_precision_follows_the_mix(llama_dir, tmp_path):
    result = export_gguf(llama_dir, tmp_path / "q4km.gguf", GGUFOptions(type="Q4_K_M"))
    types = {p.spec.name: p.qtype for p in result.tensors}
    # 2 layers: use_more_bits picks layer 1 only (the last eighth)
    assert types["blk.0.attn_v.weight"] == T.Q4_K and types["blk.1.attn_v.weight"] == T.Q6_K
    assert types["blk.0.ffn_down.weight"] == T.Q4_K and types["blk.1.ffn_down.weight"] == T.Q6_K
    assert types["output.weight"] == T.Q6_K and types["token_embd.weight"] == T.Q4_K
    assert max(result.errors.values()) < 0.12
    q4_0 = export_gguf(llama_dir, tmp_path / "q4_0.gguf", GGUFOptions(type="Q4_0"))
    kl = {r.file_type: quick_fidelity(llama_dir, r.path, max_tokens=512)["kl_mean"] for r in (result, q4_0)}
    assert 0 < kl["Q4_K_M"] < kl["Q4_0"] < 0.05  # the random model's logits are flat: small KLs


@pytest.fixture(scope="module")
def plain_llama_dir(tmp_path_factory):
    """A Llama without rope scaling: transformers' GGUF loader does not read rope.scaling.* for llama
    (it would silently drop llama_dir's linear factor), so the comparison needs a model without it."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    from quantship.models.bundled import TINY_DIR

    d = tmp_path_factory.mktemp("plain_llama")
    config = AutoConfig.for_model("llama", vocab_size=8192, hidden_size=256, intermediate_size=512,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=512)
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(d)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TINY_DIR / name, d / name)
    return d


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K_M"])
def test_transformers_loads_our_llama_gguf(plain_llama_dir, tmp_path, qtype):
    _transformers_matches_ours(plain_llama_dir, tmp_path, qtype)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_transformers_loads_our_qwen_gguf(distills, tmp_path, kind):
    _transformers_matches_ours(distills[kind], tmp_path, "Q8_0")


def _transformers_matches_ours(source, tmp_path, qtype):
    from transformers import AutoModelForCausalLM

    export_gguf(source, tmp_path / "m.gguf", GGUFOptions(type=qtype))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    ours = GGUFCheckpoint(tmp_path / "m.gguf").load_model()
    ids = torch.randint(0, 8192, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids), rtol=1e-4, atol=1e-4)


# --- bad input ---------------------------------------------------------------------------------

def test_bad_input_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    def run(*args):
        code = main(["export", *map(str, args)])
        return code, capsys.readouterr().err.strip()

    existing = tmp_path / "exists.gguf"
    existing.write_bytes(b"x")
    for args, words in [(["tiny", "--format", "gguf", "-o", existing], "exists"),
                        (["tiny", "--format", "gguf", "-o", tmp_path / "a.bin"], "must end in .gguf"),
                        ([tmp_path, "--format", "gguf", "-o", tmp_path / "b.gguf"], "no config.json"),
                        (["tiny", "--format", "gguf", "-o", tmp_path / "c.gguf", "--type", "Q3_K"],
                         "unknown GGUF type")]:
        code, err = run(*args)
        assert code == 2 and words in err and len(err.splitlines()) == 1, err
    # a failure after the header is written removes the partial file
    monkeypatch.setattr(B, "quantize", lambda *a: (_ for _ in ()).throw(QuantshipError("boom")))
    code, err = run("tiny", "--format", "gguf", "-o", tmp_path / "d.gguf", "--type", "Q8_0")
    assert code == 2 and "boom" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists.gguf"]


# --- the pre-tokenizer (tokenizer.ggml.pre) -----------------------------------------------------

@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    from tokenizer_families import FAMILIES, write_model

    root = tmp_path_factory.mktemp("families")
    return {name: write_model(name, root / name) for name in [*FAMILIES, "unknown"]}


@pytest.mark.parametrize("family", ["deepseek-v3", "deepseek-coder", "llama-bpe", "qwen2"])
def test_pre_tokenizer_of_each_family_is_named_in_the_file(family_models, tmp_path, family):
    result = export_gguf(family_models[family], tmp_path / "m.gguf", GGUFOptions(type="F16"))
    fields = GGUFCheckpoint(result.path).fields
    assert fields["tokenizer.ggml.pre"] == family and fields["tokenizer.ggml.model"] == "gpt2"
    assert f"pre-tokenizer {family} (by its splits)" in "\n".join(summary_lines(result))


def test_probe_hash_is_convert_hf_to_gguf_s_and_wins_over_the_splits(family_models, monkeypatch):
    """convert_hf_to_gguf hashes str(AutoTokenizer.encode(probe)); ours hashes tokenizers' ids: the same.
    A hash in the table names the tokenizer even where the splits would name another (R1-Distill-Qwen
    splits like qwen2; llama.cpp calls it deepseek-r1-qwen)."""
    from hashlib import sha256

    from quantship.formats import gguf_pretok
    from quantship.models.tokenizer import load_tokenizer

    for family, path in family_models.items():
        theirs = sha256(str(load_tokenizer(path).encode(gguf_pretok.PROBE)).encode()).hexdigest()
        assert gguf_pretok.identify(path / "tokenizer.json", "gpt-2").chkhsh == theirs, family
    qwen = family_models["qwen2"] / "tokenizer.json"
    monkeypatch.setitem(gguf_pretok.KNOWN_HASHES, gguf_pretok.identify(qwen).chkhsh, "deepseek-r1-qwen")
    assert gguf_pretok.identify(qwen) == gguf_pretok.PreTokenizer("deepseek-r1-qwen", "hash",
                                                                  gguf_pretok.identify(qwen).chkhsh)


def test_family_splits_tell_every_family_apart():
    from itertools import combinations

    from quantship.formats.gguf_pretok import _SPLIT_TEXT, FAMILY_SPLITS, family_pre_tokenizer

    pieces = {n: [p for p, _ in family_pre_tokenizer(n).pre_tokenize_str(_SPLIT_TEXT)] for n in FAMILY_SPLITS}
    assert all(pieces[a] != pieces[b] for a, b in combinations(pieces, 2))


def test_unknown_pre_tokenizer_is_refused_unless_named(family_models, tmp_path, capsys):
    def run(*extra):
        code = main(["export", str(family_models["unknown"]), "--format", "gguf", "--type", "F16",
                     "-o", str(tmp_path / "u.gguf"), *extra])
        return code, capsys.readouterr()

    code, out = run()
    err = out.err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "tokenizer.json: pre-tokenizer [Split('\\\\p{N}{1,5}')" in err and "--pre-tokenizer NAME" in err
    assert list(tmp_path.iterdir()) == []
    code, out = run("--pre-tokenizer", "deepseek-v4")
    assert code == 2 and "'deepseek-v4' is not a name llama.cpp knows" in out.err and list(tmp_path.iterdir()) == []
    code, out = run("--pre-tokenizer", "deepseek-v3")
    assert code == 0 and "pre-tokenizer deepseek-v3 (as given)" in out.out
    assert GGUFCheckpoint(tmp_path / "u.gguf").fields["tokenizer.ggml.pre"] == "deepseek-v3"
    code = main(["export", "tiny", "--format", "onnx", "-o", str(tmp_path / "x"), "--pre-tokenizer", "qwen2"])
    assert code == 2 and "ONNX exports carry tokenizer.json" in capsys.readouterr().err


def test_bf16_export_is_the_checkpoint(tmp_path):
    result = export_gguf("tiny", tmp_path / "bf16.gguf", GGUFOptions(type="BF16"))
    assert all(e == 0.0 for e in result.errors.values())
    assert np.isclose(result.bytes / 2**20, 37.2, atol=0.5)


# --- GPTQ on the GGUF grids ---------------------------------------------------------------------

@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K])
def test_gptq_on_a_gguf_grid_is_packed_as_computed_and_beats_rtn_on_output_error(qtype):
    from quantship.formats.gguf_gptq import gptq_tensor

    torch.manual_seed(4)
    n = 512
    x = torch.randn(2048, n) @ (torch.randn(n, n) * 0.1 + torch.eye(n))  # correlated inputs, as real ones are
    hessian = x.T @ x
    w = torch.randn(1, 16, n) * 0.02
    data = gptq_tensor(w, hessian[None], qtype, dampening=0.01)[0]
    gptq = torch.from_numpy(quants.dequantize(data, qtype))
    rtn = B.dequantize(B.quantize(w[0], qtype), qtype)

    def output_error(q):
        return float(((x @ (q - w[0]).T) ** 2).mean())

    assert output_error(gptq) < 0.9 * output_error(rtn)


def test_gptq_export_of_a_llama(plain_llama_dir, tmp_path):
    result = export_gguf(plain_llama_dir, tmp_path / "g.gguf", GGUFOptions(type="Q4_K_M", method="gptq", **FAST))
    assert result.method == "gptq" and "quantized here (GPTQ)" in "\n".join(summary_lines(result))
    rtn = export_gguf(plain_llama_dir, tmp_path / "r.gguf", GGUFOptions(type="Q4_K_M"))
    types = {p.spec.name: p.qtype for p in result.tensors}
    assert types == {p.spec.name: p.qtype for p in rtn.tensors}  # same mix, other rounding
    ours = GGUFCheckpoint(result.path).load_model()
    assert all(torch.isfinite(p).all() for p in ours.parameters())
    # every Linear and the output matrix (written last) get GPTQ; the embedding lookup has no Hessian
    assert result.gptq == sorted(p.spec.name for p in result.tensors if p.how == "quantized"
                                 and p.spec.name != "token_embd.weight")
    assert result.tensors[-1].spec.name == "output.weight" and "output.weight" in result.gptq
    assert "round-to-nearest: token_embd.weight" in "\n".join(summary_lines(result))
    with pytest.raises(QuantshipError, match="already quantized"):
        quantize(plain_llama_dir, tmp_path / "q", QuantizeOptions(group_size=32, **FAST))
        export_gguf(tmp_path / "q", tmp_path / "x.gguf", GGUFOptions(method="gptq"))


@pytest.fixture(scope="module")
def mla_32(tmp_path_factory):
    """A small DeepSeek-V3 (MLA + MoE) whose no-rope head dim is 32, so attn_k_b's rows fit Q4_0 blocks,
    with a DeepSeek-V3-style tokenizer."""
    from tokenizer_families import write_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    from reference_models import CONFIGS

    d = tmp_path_factory.mktemp("mla32")
    spec = dict(CONFIGS["deepseek_v3"], qk_nope_head_dim=32)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(d)
    return write_tokenizer("deepseek-v3", d, vocab_size=500)


def test_query_hessians_are_each_heads_no_rope_query():
    from quantship.formats.gguf_gptq import _QueryHessians
    from quantship.models.bundled import TINY_DIR

    attn = Checkpoint(TINY_DIR).layer(1, dtype=torch.float32).self_attn
    x = torch.randn(2, 16, attn.q_a_proj.in_features)
    hook = _QueryHessians(attn)
    with torch.no_grad():
        q = attn.queries(attn.project(x)[0])
    hook.handle.remove()
    q_nope = q.reshape(-1, attn.heads, q.shape[-1] // attn.heads)[..., :attn.nope]
    for h in range(attn.heads):
        torch.testing.assert_close(hook.sum[h], q_nope[:, h].T @ q_nope[:, h])


def test_gptq_rounds_attn_k_b_per_head_and_the_output_matrix(mla_32, tmp_path):
    result = export_gguf(mla_32, tmp_path / "g.gguf", GGUFOptions(type="Q4_0", method="gptq", **FAST))
    k_b = [p.spec.name for p in result.tensors if "attn_k_b" in p.spec.name]
    assert k_b and set(k_b) <= set(result.gptq) and "output.weight" in result.gptq
    assert "attn_k_b per head on its query: 3" in "\n".join(summary_lines(result))
    assert quick_fidelity(mla_32, result.path, max_tokens=256)["kl_mean"] < 0.5


# --- importance matrix (--imatrix) ---------------------------------------------------------------

@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0])
def test_imatrix_lowers_the_activation_weighted_error_of_rtn(qtype):
    """Inputs whose columns differ in scale (as real activations do): weighing each block's fit by
    the mean squared activation per column lowers the output error ||X (Q(W) - W)^T|| against plain RTN
    on the same grid; Q8_0 ignores the imatrix, as in llama.cpp."""
    torch.manual_seed(6)
    n = 512
    x = torch.randn(4096, n) * torch.exp(0.5 * torch.randn(n))
    imatrix = (x * x).mean(0)
    w = torch.randn(2, 32, n) * 0.02  # two stacked experts, each with its own importance row

    def output_error(data):
        q = B.dequantize(data, qtype).reshape(w.shape)
        return float(((x @ (q - w).transpose(1, 2)) ** 2).mean())

    plain = B.quantize(w, qtype)
    weighted = B.quantize(w, qtype, torch.stack([imatrix, imatrix]))
    assert weighted.shape == plain.shape
    if qtype == T.Q8_0:
        assert np.array_equal(weighted, plain)
    else:
        assert output_error(weighted) < 0.9 * output_error(plain)


def test_imatrix_export_of_a_llama(plain_llama_dir, tmp_path, capsys):
    from quantship.formats.gguf_imatrix import collect_imatrix

    ck = Checkpoint(plain_llama_dir)
    imatrix = collect_imatrix(ck, None, **FAST)
    assert imatrix.tokens == 8 * 128 and set(imatrix.columns) >= {"lm_head.weight",
                                                                  "model.layers.1.mlp.down_proj.weight"}
    files = {flag: export_gguf(plain_llama_dir, tmp_path / f"{flag}.gguf",
                               GGUFOptions(type="Q4_0", imatrix=flag, **FAST)) for flag in (False, True)}
    with_imatrix = files[True]
    assert with_imatrix.imatrix_tensors == 2 * 7 + 1  # every Linear and the output; not the embeddings
    assert "14 weighted" not in (text := "\n".join(summary_lines(with_imatrix)))
    assert "15 weighted by an imatrix of 1024 calibration tokens" in text
    g = {flag: GGUFCheckpoint(r.path) for flag, r in files.items()}
    assert g[True].fields["quantize.imatrix.chunks_count"] == 8 and "quantize.imatrix.dataset" not in g[False].fields
    better = []
    for spec in [p.spec for p in with_imatrix.tensors if p.how == "quantized" and p.spec.name != "token_embd.weight"]:
        w = ck.read([spec.sources[0]])[spec.sources[0]].float()
        imp = imatrix.columns[spec.sources[0]]
        ours = {flag: g[flag].read(spec.name).reshape(-1, w.shape[-1]) for flag in g}
        w = g[True].read(spec.name).new_tensor(0) + w[_rows(spec, ck)]  # GGUF row order
        err = {flag: float(((ours[flag] - w) ** 2 * imp).sum()) for flag in ours}
        better.append(err[True] < err[False])
    assert all(better), better
    code = main(["export", str(plain_llama_dir), "--format", "gguf", "-o", str(tmp_path / "x.gguf"),
                 "--method", "gptq", "--imatrix"])
    assert code == 2 and "GPTQ already uses the full input Hessian" in capsys.readouterr().err


def _rows(spec, ck):
    from quantship.formats.gguf_layout import forward_rows

    rows = forward_rows(spec, ck.config, spec.shape[0])
    return slice(None) if rows is None else rows


# --- the R1 distills' architectures: qwen2, qwen3, llama with llama3 rope ------------------------

@pytest.fixture(scope="module")
def distills(tmp_path_factory):
    """Small Qwen2 (q/k/v biases), Qwen3 (q/k norms, tied embeddings) and Llama-3.1-rope models
    with the bundled tokenizer, from a fixed seed."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    from quantship.models.bundled import TINY_DIR

    from test_qwen import _save_qwen

    out = {kind: _save_qwen(kind, tmp_path_factory.mktemp(kind)) for kind in ("qwen2", "qwen3")}
    d = tmp_path_factory.mktemp("llama3")
    config = AutoConfig.for_model("llama", vocab_size=8192, hidden_size=256, intermediate_size=512,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=1024, rope_theta=500000.0,
                                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 128})
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(d)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TINY_DIR / name, d / name)
    out["llama3"] = d
    return out


@pytest.mark.parametrize("kind,arch,marker", [("qwen2", "qwen2", "blk.0.attn_q.bias"),
                                              ("qwen3", "qwen3", "blk.0.attn_q_norm.weight"),
                                              ("llama3", "llama", "rope_freqs.weight")])
def test_distill_architectures_round_trip(distills, tmp_path, kind, arch, marker):
    result = export_gguf(distills[kind], tmp_path / "m.gguf", GGUFOptions(type="F16"))
    g = GGUFCheckpoint(result.path)
    assert result.arch == arch and marker in g.tensors and g.types()[marker] == "F32"
    assert ("output.weight" in g.tensors) == (kind != "qwen3")  # qwen3 here ties its embeddings
    base = Checkpoint(distills[kind])
    for key in ("architecture", "num_key_value_heads", "llama_head_dim", "tie_word_embeddings", "rope"):
        assert getattr(g.config, key) == getattr(base.config, key), key
    ids = torch.randint(0, 8192, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        p, q = base.load_model()(ids).log_softmax(-1), g.load_model()(ids).log_softmax(-1)
    assert float((p.exp() * (p - q)).sum(-1).mean()) < 1e-4  # F16 weights: only their rounding differs


def test_deepseek_fp8_source_exports_as_the_model_it_stands_for(tmp_path):
    """DeepSeek-V3/R1 as published (FP8 blocks + an MTP layer): the GGUF holds the dequantized weights,
    without the MTP layer (llama.cpp's converter drops it too)."""
    from quantship.models.bundled import TINY_DIR

    from fp8_models import convert_to_fp8

    fp8 = convert_to_fp8(TINY_DIR, tmp_path / "fp8")
    result = export_gguf(fp8, tmp_path / "fp8.gguf", GGUFOptions(type="F16"))
    g = GGUFCheckpoint(result.path)
    assert not any(name.startswith("blk.8.") for name in g.tensors) and g.config.num_hidden_layers == 8
    ours = Checkpoint(fp8).layer(3).self_attn.q_b_proj.weight
    assert torch.equal(g.read("blk.3.attn_q_b.weight"), ours.half().float())


def test_block_scaled_fp8_checkpoint_is_requantized_from_its_values(plain_llama_dir, tmp_path):
    from quantship.quant.scheme import PRESETS

    if "FP8_BLOCK" not in PRESETS:
        pytest.skip("no FP8_BLOCK scheme in this tree")
    quantize(plain_llama_dir, tmp_path / "fp8", QuantizeOptions(scheme="FP8_BLOCK", **FAST))
    result = export_gguf(tmp_path / "fp8", tmp_path / "fp8.gguf", GGUFOptions(type="Q8_0"))
    ours = _weights(Checkpoint(tmp_path / "fp8").load_model())
    theirs = _weights(GGUFCheckpoint(result.path).load_model())
    w = ours["model.layers.0.mlp.down_proj.weight"]
    assert float((theirs["model.layers.0.mlp.down_proj.weight"] - w).norm() / w.norm()) < 0.01  # Q8_0 rounding
