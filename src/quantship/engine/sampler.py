"""Draw the next token of every sequence in the step from its logits row."""

from __future__ import annotations

import torch

from quantship.engine.sampling import SamplingParams


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits [V] float32 → token id, with temperature, top-k and top-p (nucleus) filtering."""
    if params.temperature <= 0:
        return int(logits.argmax())
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < params.top_p  # the most likely token always stays
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           want_logprobs: list[bool]) -> tuple[list[int], list[float | None]]:
    """logits [S, V] → one token per row and, where asked, its log-probability under the model."""
    logits = logits.float().cpu()
    greedy = logits.argmax(dim=-1).tolist()  # one vectorised pass serves every greedy row
    tokens = [g if p.temperature <= 0 else sample_row(row, p, gen)
              for row, g, p, gen in zip(logits, greedy, params, generators)]
    logprobs: list[float | None] = [None] * len(tokens)
    rows = [i for i, want in enumerate(want_logprobs) if want]
    if rows:
        chosen = torch.log_softmax(logits[rows], dim=-1).gather(1, torch.tensor([[tokens[i]] for i in rows]))
        for i, value in zip(rows, chosen[:, 0].tolist()):
            logprobs[i] = value
    return tokens, logprobs
