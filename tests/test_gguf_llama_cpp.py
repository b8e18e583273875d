"""llama.cpp itself (llama-cpp-python, built from source by `make test-llama-cpp`) on our GGUF files:
it loads the deepseek2 and llama files, tokenizes like us, its logits on held-out text agree with
our model of the same file, it generates the same greedy tokens, and its own quantizer picks the
same type for every tensor as our transcription of its rules.

llama.cpp's CPU kernels for quantized types quantize the activations to 8 bits too (Q8_0 / Q8_K
dot products), so on those files its logits differ from the dequantized model by that rounding:
the KL bound is small but not zero; on F16 files the two are the same model.
"""

import ctypes

import gguf
import numpy as np
import pytest
import torch

from quantship.formats.gguf import GGUFOptions, export_gguf
from quantship.formats.gguf_read import GGUFCheckpoint
from quantship.models.bundled import TINY_DIR
from quantship.models.reference_loop import generate_tokens
from quantship.models.tokenizer import load_tokenizer
from quantship.quant.pipeline import QuantizeOptions, quantize

from test_gguf import distills  # noqa: F401  (the fixture)

llama_cpp = pytest.importorskip("llama_cpp", reason="llama.cpp is installed by `make test-llama-cpp`")


def _llama(path):
    return llama_cpp.Llama(model_path=str(path), n_ctx=512, logits_all=True, verbose=False, n_threads=2, seed=0)


def _eval_ids(n: int = 256) -> list[int]:
    text = (TINY_DIR / "eval.txt").read_text(encoding="utf-8")[:4000]
    return load_tokenizer(TINY_DIR)(text, add_special_tokens=False)["input_ids"][:n]


def _compare(path) -> dict:
    ids = _eval_ids()
    llm = _llama(path)
    llm.reset()
    llm.eval(ids)
    theirs = torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))
    model = GGUFCheckpoint(path).load_model()
    with torch.no_grad():
        ours = model(torch.tensor([ids]))[0]
    lp, lq = ours.log_softmax(-1), theirs.log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    prompt = load_tokenizer(TINY_DIR)("def fibonacci(n):")["input_ids"]
    ours_greedy = list(generate_tokens(model, prompt, 32))
    theirs_greedy = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        theirs_greedy.append(token)
        if len(theirs_greedy) == 32:
            break
    return {"kl": float(kl.mean()), "top1": float((ours.argmax(-1) == theirs.argmax(-1)).float().mean()),
            "greedy_same": ours_greedy == theirs_greedy, "llm": llm}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama_cpp")
    quantize("tiny", root / "w4g32", QuantizeOptions(scheme="W4A16", group_size=32, samples=8, seq_len=128))
    return {"f16": export_gguf("tiny", root / "tiny-f16.gguf", GGUFOptions(type="F16")).path,
            "q4_0": export_gguf(root / "w4g32", root / "tiny-q4_0.gguf", GGUFOptions()).path,
            "q4_k_m": export_gguf("tiny", root / "tiny-q4_k_m.gguf", GGUFOptions(type="Q4_K_M")).path}


def test_llama_cpp_runs_our_deepseek2_f16_as_the_same_model(files):
    r = _compare(files["f16"])
    assert r["kl"] < 1e-4 and r["top1"] == 1.0 and r["greedy_same"]
    text = (TINY_DIR / "eval.txt").read_text(encoding="utf-8")[:4000]
    assert r["llm"].tokenize(text.encode(), add_bos=False)[:256] == _eval_ids()  # the same tokenizer


@pytest.mark.parametrize("name", ["q4_0", "q4_k_m"])
def test_llama_cpp_runs_our_quantized_deepseek2(files, name):
    r = _compare(files[name])
    assert r["kl"] < 0.01 and r["top1"] > 0.95 and r["greedy_same"]


def test_llama_cpp_runs_our_llama(llama_dir, tmp_path):
    for qtype, bound in (("F16", 1e-4), ("Q8_0", 1e-3)):
        r = _compare(export_gguf(llama_dir, tmp_path / f"{qtype}.gguf", GGUFOptions(type=qtype)).path)
        assert r["kl"] < bound, qtype


def _llama_cpp_quantize(src, dst, file_type: str) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(getattr(gguf.LlamaFileType, f"MOSTLY_{file_type}"))
    params.nthread = 2
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) == 0


@pytest.mark.parametrize("file_type", ["Q4_K_M", "Q5_K_M", "Q6_K", "Q4_0"])
def test_our_type_mix_is_llama_cpps(files, llama_dir, tmp_path, file_type):
    for name, source, f16 in (("tiny", "tiny", files["f16"]), ("llama", llama_dir, None)):
        if f16 is None:
            f16 = export_gguf(source, tmp_path / f"{name}-f16.gguf", GGUFOptions(type="F16")).path
        _llama_cpp_quantize(f16, tmp_path / f"{name}-theirs.gguf", file_type)
        ours = export_gguf(source, tmp_path / f"{name}-ours.gguf", GGUFOptions(type=file_type))
        theirs = GGUFCheckpoint(tmp_path / f"{name}-theirs.gguf").types()
        assert GGUFCheckpoint(ours.path).types() == theirs, name


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama3"])
def test_llama_cpp_runs_our_distill_architectures(distills, tmp_path, kind):  # noqa: F811 (the imported fixture)
    r = _compare(export_gguf(distills[kind], tmp_path / f"{kind}.gguf", GGUFOptions(type="F16")).path)
    assert r["kl"] < 1e-4 and r["greedy_same"], kind


@pytest.mark.parametrize("family", ["deepseek-v3", "deepseek-coder", "llama-bpe", "qwen2"])
def test_llama_cpp_tokenizes_each_family_as_its_tokenizer_does(tmp_path, family):
    """The name we identify makes llama.cpp split text as the model's own tokenizer.json does (ids equal
    on the probe text, code, CJK and the held-out text); another family's name would not. (DeepSeek-Coder's
    splits are the finest of all, so a vocabulary trained under them tokenizes alike under every name;
    the other families' files do differ under its name.)"""
    from tokenizer_families import write_model
    from tokenizers import Tokenizer

    from quantship.formats.gguf_pretok import _SPLIT_TEXT, FAMILY_SPLITS

    model = write_model(family, tmp_path / "m")
    text = _SPLIT_TEXT + (TINY_DIR / "eval.txt").read_text(encoding="utf-8")[:3000]
    ours = Tokenizer.from_file(str(model / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    same = {}
    for name in [None, *(n for n in FAMILY_SPLITS if n != family)]:
        path = export_gguf(model, tmp_path / f"{name}.gguf", GGUFOptions(type="F16", pre_tokenizer=name)).path
        vocab = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        same[name] = vocab.tokenize(text.encode(), add_bos=False, special=False) == ours
    assert same.pop(None), "llama.cpp tokenizes differently from tokenizer.json under the identified name"
    assert family == "deepseek-coder" or not all(same.values()), same
