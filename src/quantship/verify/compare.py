"""A quick fidelity figure (mean KL, top-1, perplexities) for the demo and tests; `verify` has the rest."""

from __future__ import annotations

import math
from pathlib import Path

from quantship.formats.gguf_read import open_checkpoint
from quantship.models.bundled import bundled_texts, resolve_model
from quantship.models.loader import Checkpoint
from quantship.models.tokenizer import load_tokenizer
from quantship.verify.evaluate import chunk_rows, compare


def quick_fidelity(base: str | Path | None, quant: str | Path, text: Path | None = None, ctx: int = 512,
                   max_tokens: int = 16384, device: str = "cpu") -> dict:
    """Mean KL, top-1 agreement and both perplexities over up to `max_tokens` tokens of held-out text."""
    base_path = resolve_model(base)
    text = text or bundled_texts()["eval_text"]
    tokenizer = load_tokenizer(base_path)
    ids = tokenizer(text.read_text(encoding="utf-8"), add_special_tokens=False, verbose=False)["input_ids"]
    models = [Checkpoint(base_path).load_model(device=device), open_checkpoint(quant)[1].load_model(device=device)]
    rec = compare(*models, chunk_rows(ids, ctx, max_tokens), device)
    return {
        "tokens": int(rec["kl"].numel()),
        "kl_mean": float(rec["kl"].mean()),
        "top1_agreement": float(rec["top1"].mean()),
        "ppl_base": math.exp(float(-rec["logp_base"].mean())),
        "ppl_quant": math.exp(float(-rec["logp_quant"].mean())),
    }
