"""The plain one-request generation loop: the reference the serving engine is checked against."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from quantship.models.causal_lm import CausalLM
from quantship.models.next_token import draw


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
        token = int(draw(logits.cpu().float(), temperature, top_p, generator=generator))
        yield token
        if stop_ids and token in stop_ids:
            return
        ids = torch.tensor([[token]], device=device)
