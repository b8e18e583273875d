"""Prompts for the load: real text cut to an exact token count, or the user's own JSONL file.

Synthetic prompts are slices of the bundled evaluation text (code, prose, verse), not random token
ids: random ids make tokenizers and prefix caches behave unlike production. Each prompt starts at a
different place so a server's prefix cache cannot turn the benchmark into a cache benchmark.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from quantship.errors import QuantshipError

MAX_DISTINCT_PROMPTS = 256  # more requests than this cycle through them


@dataclass
class Prompt:
    text: str
    tokens: int  # counted with the tokenizer, without special tokens (the server adds BOS itself)


def load_bench_tokenizer(directory: Path | None):
    from quantship.models.bundled import resolve_model
    from quantship.models.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(str(directory) if directory else "tiny"))


def count_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def synthetic_prompts(tokenizer, input_len: int, count: int, source: Path | None = None) -> list[Prompt]:
    """`count` (at most MAX_DISTINCT_PROMPTS) prompts of exactly `input_len` tokens each."""
    from quantship.models.bundled import bundled_texts

    text = (source or bundled_texts()["eval_text"]).read_text(encoding="utf-8", errors="replace")
    ids = _tokenize_long(tokenizer, text)
    if len(ids) < input_len + 16:
        raise QuantshipError(f"the prompt source has {len(ids)} tokens, fewer than --input-len {input_len}", source)
    count = max(1, min(count, MAX_DISTINCT_PROMPTS))
    stride = max(1, (len(ids) - input_len - 16) // count)
    return [_exact_slice(tokenizer, ids, k * stride, input_len) for k in range(count)]


def _tokenize_long(tokenizer, text: str, piece: int = 2000) -> list[int]:
    # In pieces cut at line ends: one call on 500 KB makes transformers warn about the model's max length.
    ids: list[int] = []
    start = 0
    while start < len(text):
        end = text.find("\n", start + piece)
        end = len(text) if end < 0 else end + 1
        ids += tokenizer(text[start:end], add_special_tokens=False)["input_ids"]
        start = end
    return ids


def _exact_slice(tokenizer, ids: list[int], start: int, want: int) -> Prompt:
    # Decoding a slice and encoding it again need not give the same count (merges across the cut),
    # so adjust the slice length until the text itself encodes to `want` tokens.
    take = want
    best = None
    for _ in range(8):
        text = tokenizer.decode(ids[start:start + take])
        got = count_tokens(tokenizer, text)
        if best is None or abs(got - want) < abs(best.tokens - want):
            best = Prompt(text, got)
        if got == want:
            break
        take = max(1, take + want - got)
    return best


def file_prompts(path: Path, tokenizer) -> list[Prompt]:
    """A JSONL file, one {"prompt": "..."} object per line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise QuantshipError(f"cannot read prompts ({exc.strerror})", path) from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError:
            raise QuantshipError(f"line {number} is not JSON", path) from None
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"]:
            raise QuantshipError(f'line {number} needs a non-empty string "prompt"', path)
        prompts.append(Prompt(item["prompt"], count_tokens(tokenizer, item["prompt"])))
    if not prompts:
        raise QuantshipError("no prompts in file", path)
    return prompts
