"""The tokenizer block of a GGUF file: BPE tokens, their types, merges, special tokens, chat template.

Read from the model's own tokenizer.json (no transformers, nothing fetched); merges, special token
ids, add_bos/add_eos and the chat template go through gguf-py's SpecialVocab, as convert_hf_to_gguf
does. llama.cpp picks its pre-tokenizer (the regex that splits text before BPE) by name; a name it
does not know, or the wrong one, tokenizes differently from the model, so an unknown pre-tokenizer
is an error here rather than a guess.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import gguf

from quantship.errors import QuantshipError

# The GPT-2 split regex as tokenizers' ByteLevel pre-tokenizer applies it (use_regex) — the tiny model's.
_GPT2 = {"type": "ByteLevel", "use_regex": True}
# Other families (deepseek-llm, deepseek-coder, deepseek-v3, llama-bpe) split with explicit regexes;
# convert_hf_to_gguf.py tells them apart by hashing a tokenized probe text. Not done here yet: such a
# tokenizer is refused rather than named by a guess.


def pre_tokenizer_name(tokenizer: dict, source: Path) -> str:
    pre = tokenizer.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and all(pre.get(k) == v for k, v in _GPT2.items()):
        return "gpt-2"
    raise QuantshipError(f"pre-tokenizer {pre.get('type')!r} is not supported yet (only the GPT-2 byte-level "
                         "split); naming it wrongly would make llama.cpp tokenize differently", source)


def add_tokenizer(writer: gguf.GGUFWriter, model_dir: Path, vocab_size: int) -> dict:
    """Writes the tokenizer keys; returns a short description for the export summary."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise QuantshipError("no tokenizer.json (GGUF files carry their tokenizer)", model_dir)
    try:
        tokenizer = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise QuantshipError(f"malformed JSON ({exc})", path) from None
    model = tokenizer.get("model") or {}
    if model.get("type") != "BPE":
        raise QuantshipError(f"tokenizer model {model.get('type')!r} is not supported (BPE only)", path)
    pre = pre_tokenizer_name(tokenizer, path)
    tokens: dict[int, tuple[str, int]] = {i: (t, gguf.TokenType.NORMAL) for t, i in model["vocab"].items()}
    for added in tokenizer.get("added_tokens", []):
        kind = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
        tokens[added["id"]] = (added["content"], kind)
    if max(tokens) >= vocab_size:
        raise QuantshipError(f"tokenizer has token id {max(tokens)} beyond vocab_size {vocab_size}", path)
    # Ids the tokenizer never produces (embedding rows padded to a round size) get placeholder tokens.
    listed = [tokens.get(i, (f"[PAD{i}]", gguf.TokenType.UNUSED)) for i in range(vocab_size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list([t for t, _ in listed])
    writer.add_token_types([int(k) for _, k in listed])
    quiet = logging.getLogger("gguf")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # gguf-py warns about post-processor details that do not reach the file
    try:
        special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=vocab_size)
    finally:
        quiet.setLevel(level)
    if not special.merges:
        raise QuantshipError("tokenizer.json has no BPE merges", path)
    special.add_to_gguf(writer, quiet=True)
    return {"pre": pre, "tokens": len(tokens), "merges": len(special.merges),
            "chat_template": bool(special.chat_template)}
