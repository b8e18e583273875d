"""How the next token is drawn from a row of logits: greedy, or sampled with temperature, top-k and top-p.

One function for the plain one-request loop (reference_loop.py) and the serving engine (engine/sampler.py),
so a seeded request draws the same tokens in both. It stays on the logits' device: no host synchronisation.
"""

from __future__ import annotations

import torch


def draw(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0,
         generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [V] float32 → token id (a 0-d tensor on logits' device). temperature 0 is greedy; top_k 0 is off."""
    if temperature <= 0:
        return logits.argmax()
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < top_p  # the most likely token always stays
        # A mask, not boolean indexing: indexing would wait for the device to count the kept tokens.
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs * keep)
    return torch.multinomial(probs, 1, generator=generator)[0]
