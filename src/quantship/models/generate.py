"""The plain one-request generation loop: the reference the serving engine is checked against."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from quantship.models.causal_lm import CausalLM


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < top_p  # always keeps the most likely token
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate_tokens(
    model: CausalLM,
    prompt_ids: list[int],
    max_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop_ids: set[int] | None = None,
) -> Iterator[int]:
    """Yield new token ids one at a time (greedy when temperature is 0), using the MLA/KV cache."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    cache = model.new_cache()
    limit = model.config.max_position_embeddings
    ids = torch.tensor([prompt_ids], device=device)
    for _ in range(max_tokens):
        if cache.length + ids.shape[1] > limit:
            return
        logits = model(ids, cache=cache)[0, -1]
        token = sample_next(logits.cpu(), temperature, top_p, generator)
        yield token
        if stop_ids and token in stop_ids:
            return
        ids = torch.tensor([[token]], device=device)
