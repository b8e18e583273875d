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
        raise QuantshipError(f"cannot load the tokenizer ({type(exc).__name__}: {exc})", path) from None


def eos_ids(tokenizer, config_eos) -> set[int]:
    ids = set(config_eos if isinstance(config_eos, list) else [config_eos] if config_eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
