"""Tokenizer loading: transformers' tokenizer classes, from local files only."""

from __future__ import annotations

import os
from pathlib import Path

from quantship.errors import QuantshipError


def load_tokenizer(path: Path):
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise QuantshipError("no tokenizer files (tokenizer.json / tokenizer_config.json)", path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises many types here; the user needs one line, not a trace
        why = " ".join(str(exc).split())  # some of its messages are numbered lists over several lines
        why = why if len(why) <= 300 else why[:297] + "..."
        missing = "" if (path / "tokenizer.json").is_file() else "no tokenizer.json; "
        raise QuantshipError(f"cannot load the tokenizer ({missing}{type(exc).__name__}: {why})", path) from None


def tokenizer_summary(path: Path) -> dict:
    """What `info` says of a model's tokenizer: its size, whether it has a chat template (the chat API
    and `generate --chat` need one), its end-of-sequence token; or why it does not load, so a broken
    tokenizer shows before `serve` does."""
    try:
        tokenizer = load_tokenizer(path)
    except QuantshipError as exc:
        return {"error": str(exc)}
    return {"class": type(tokenizer).__name__, "vocab": len(tokenizer),
            "chat_template": bool(getattr(tokenizer, "chat_template", None)), "eos_token": tokenizer.eos_token}


def eos_ids(tokenizer, config_eos) -> set[int]:
    ids = set(config_eos if isinstance(config_eos, list) else [config_eos] if config_eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
