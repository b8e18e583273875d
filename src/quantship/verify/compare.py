"""Teacher-forced comparison of two checkpoints on held-out text, chunk by chunk."""

from __future__ import annotations

from pathlib import Path

import torch

from quantship.models.bundled import bundled_texts, resolve_model
from quantship.models.loader import Checkpoint
from quantship.models.tokenizer import load_tokenizer
from quantship.verify.metrics import token_kl, top1_agreement


@torch.no_grad()
def quick_fidelity(base: str | Path | None, quant: str | Path, text: Path | None = None, ctx: int = 512,
                   max_tokens: int = 16384, device: str = "cpu") -> dict:
    """Mean KL, top-1 agreement and both perplexities over up to `max_tokens` tokens of held-out text.

    Whole-vocabulary logits are kept for one chunk at a time only.
    """
    base_path, quant_path = resolve_model(base), resolve_model(quant)
    text = text or bundled_texts()["eval_text"]
    tokenizer = load_tokenizer(base_path)
    ids = tokenizer(text.read_text(encoding="utf-8"), add_special_tokens=False, verbose=False)["input_ids"]
    chunks = max(1, min(len(ids), max_tokens) // ctx)
    rows = torch.tensor(ids[: chunks * ctx]).view(chunks, ctx).to(device)
    models = [Checkpoint(p).load_model(device=device) for p in (base_path, quant_path)]
    kl, agree, nll = [], [], [[], []]
    for row in rows:
        logits = [m(row[None])[0, :-1] for m in models]
        kl.append(token_kl(*logits))
        agree.append(top1_agreement(*logits))
        for k, lg in enumerate(logits):
            nll[k].append(torch.nn.functional.cross_entropy(lg.float(), row[1:], reduction="none"))
    kl_all, nll_b, nll_q = torch.cat(kl), torch.cat(nll[0]), torch.cat(nll[1])
    return {
        "tokens": int(kl_all.numel()),
        "kl_mean": float(kl_all.mean()),
        "top1_agreement": float(torch.cat(agree).mean()),
        "ppl_base": float(nll_b.mean().exp()),
        "ppl_quant": float(nll_q.mean().exp()),
    }
