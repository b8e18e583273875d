"""The tokenizer block of a GGUF file: BPE tokens, their types, merges, special tokens, chat template.

Read from the model's own tokenizer.json (no transformers, nothing fetched); merges, special token
ids, add_bos/add_eos and the chat template go through gguf-py's SpecialVocab, as convert_hf_to_gguf
does. llama.cpp picks its pre-tokenizer (the regex that splits text before BPE) by name; a name it
does not know, or the wrong one, tokenizes differently from the model: gguf_pretok.py identifies it
the way convert_hf_to_gguf does (a hash of the tokenized probe text), or by its splits, and refuses a
pre-tokenizer it cannot name rather than guessing.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import gguf

from quantship.errors import QuantshipError
from quantship.formats.gguf_pretok import identify


def add_tokenizer(writer: gguf.GGUFWriter, model_dir: Path, vocab_size: int, pre_tokenizer: str | None = None) -> dict:
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
    pre = identify(path, pre_tokenizer)
    tokens: dict[int, tuple[str, int]] = {i: (t, gguf.TokenType.NORMAL) for t, i in model["vocab"].items()}
    for added in tokenizer.get("added_tokens", []):
        kind = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
        tokens[added["id"]] = (added["content"], kind)
    if max(tokens) >= vocab_size:
        raise QuantshipError(f"tokenizer has token id {max(tokens)} beyond vocab_size {vocab_size}", path)
    # Ids the tokenizer never produces (embedding rows padded to a round size) get placeholder tokens.
    listed = [tokens.get(i, (f"[PAD{i}]", gguf.TokenType.UNUSED)) for i in range(vocab_size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre.name)
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
    return {"pre": pre.name, "pre_how": pre.how, "tokens": len(tokens), "merges": len(special.merges),
            "chat_template": bool(special.chat_template)}
