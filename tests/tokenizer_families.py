"""Small BPE tokenizers with the pre-tokenizers of the published DeepSeek-V3/R1, DeepSeek-Coder,
Llama-3 (R1-Distill-Llama) and Qwen2 (R1-Distill-Qwen) tokenizer.json files, trained here on the
bundled calibration text (the real vocabularies cannot be downloaded in tests).

The `pre_tokenizer` blocks are written as those files declare them (Split regexes, Digits,
ByteLevel without its own regex), not as llama.cpp restates them, so identifying them by their
splits is a real check of quantship's table against the models' own declarations.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from quantship.models.bundled import TINY_DIR

_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}


def _split(regex: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
DS_BOS, DS_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

# family → (pre_tokenizer as the published tokenizer.json has it, normalizer, bos, eos, add_bos, ignore_merges)
FAMILIES = {
    "deepseek-v3": ({"type": "Sequence", "pretokenizers": [
        _split(r"\p{N}{1,3}"), _split("[一-龥぀-ゟ゠-ヿ]+"),
        _split(r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
               r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
        _BYTE_LEVEL]}, None, DS_BOS, DS_EOS, True, False),
    "deepseek-coder": ({"type": "Sequence", "pretokenizers": [
        _split("[\r\n]"), _split(r"\s?\p{L}+"), _split(r"\s?\p{P}+"), _split("[一-龥ࠀ-一가-퟿]+"),
        {"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]},
        {"type": "Sequence", "normalizers": []}, DS_BOS, DS_EOS, True, False),
    "llama-bpe": ({"type": "Sequence", "pretokenizers": [_split(_LLAMA3_REGEX), _BYTE_LEVEL]}, None,
                  "<|begin_of_text|>", "<|end_of_text|>", True, True),
    "qwen2": ({"type": "Sequence", "pretokenizers": [
        _split(_LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")), dict(_BYTE_LEVEL, trim_offsets=False)]},
        {"type": "NFC"}, None, "<|endoftext|>", False, False),
}
# A pre-tokenizer no family has: digits in runs of up to five.
UNKNOWN = ({"type": "Sequence", "pretokenizers": [_split(r"\p{N}{1,5}"), _split(r" ?\p{L}+"), _BYTE_LEVEL]},
           None, DS_BOS, DS_EOS, True, False)


def write_tokenizer(family: str, out: Path, vocab_size: int = 600) -> Path:
    """tokenizer.json + tokenizer_config.json of `family` (or "unknown") in `out`; returns `out`."""
    pre, normalizer, bos, eos, add_bos, ignore_merges = FAMILIES[family] if family in FAMILIES else UNKNOWN
    specials = [t for t in (bos, eos) if t]
    base = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    base.decoder = decoders.ByteLevel()
    base.pre_tokenizer = pre_tokenizers.ByteLevel()  # replaced by the family's own block just below
    spec = json.loads(base.to_str())
    spec["pre_tokenizer"], spec["normalizer"] = pre, normalizer
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = (TINY_DIR / "calib.txt").read_text(encoding="utf-8").splitlines()
    tokenizer.train_from_iterator(lines, trainer)
    spec = json.loads(tokenizer.to_str())
    if add_bos:
        bos_id = tokenizer.token_to_id(bos)
        spec["post_processor"] = {
            "type": "TemplateProcessing", "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                                                     {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
              "add_bos_token": add_bos, "add_eos_token": False, "model_max_length": 4096}
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    return out


def write_model(family: str, out: Path) -> Path:
    """A one-layer Llama (random weights, seed 0) with `family`'s tokenizer: enough for a GGUF file."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=640, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                  max_position_embeddings=256)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return write_tokenizer(family, out)
