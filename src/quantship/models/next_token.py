"""How the next token is drawn from a row of logits: greedy, or sampled with temperature, top-k and top-p.

One function for the plain one-request loop (reference_loop.py) and the serving engine (engine/sampler.py),
so a seeded request draws the same tokens in both. It stays on the logits' device: no host synchronisation.
"""

from __future__ import annotations

import torch

# Temperatures below this draw greedily (vLLM's threshold too): divided by a smaller one, float32 logits
# overflow, and their softmax is NaN.
GREEDY_BELOW = 1e-5


def draw(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0,
         generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [V] float32 → token id (a 0-d tensor on logits' device). Temperatures below GREEDY_BELOW
    (0 included) are greedy; top_k 0 is off."""
    if temperature < GREEDY_BELOW:
        return logits.argmax()
    if 0 < top_k < logits.shape[-1]:  # on the raw logits: a huge temperature must not flatten the order first
        kth = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    # Shift the largest logit to 0 before dividing: a small temperature then sends the others to -inf (a
    # one-hot softmax) instead of every logit to +-inf, whose softmax is NaN. Capped where float32 still
    # holds it (-inf / inf is NaN); any temperature that large is uniform over the kept tokens already.
    logits = (logits - logits.max()) / min(temperature, 1e30)
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < top_p
        keep[:1].fill_(True)  # the top token always stays (a top_p below float32's range); fill_, not a host copy
        # A mask, not boolean indexing: indexing would wait for the device to count the kept tokens.
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs * keep)
    return torch.multinomial(probs, 1, generator=generator)[0]
