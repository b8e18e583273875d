"""Draw the next token of every sequence in the step from its logits row, on the logits' device.

Everything stays on the device (greedy argmax, temperature, top-k, top-p, seeded draws, log-probs);
the step's only host synchronisation is the one read of the chosen token ids (and log-probs), which
a step run ahead (engine.py) makes after launching the next step.
"""

from __future__ import annotations

import torch

from quantship.engine.sampling_params import SamplingParams
from quantship.models.next_token import GREEDY_BELOW, draw


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits [V] float32 → token id (a 0-d tensor on logits' device), with temperature, top-k and top-p."""
    return draw(logits, params.temperature, params.top_p, params.top_k, generator)


def draw_tokens(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                want_logprobs: list[bool]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [S, V] → (token per row [S], on the device; log-probabilities of the rows that want them,
    in row order, or None): nothing read on the host."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1)  # one vectorised pass serves every greedy row
    drawn = [i for i, p in enumerate(params) if p.temperature >= GREEDY_BELOW]
    if drawn:
        values = torch.stack([sample_row(logits[i], params[i], generators[i]) for i in drawn])
        tokens.index_copy_(0, _index(drawn, tokens.device), values)
    rows = [i for i, want in enumerate(want_logprobs) if want]
    if not rows:
        return tokens, None
    index = _index(rows, tokens.device)
    chosen = torch.log_softmax(logits.index_select(0, index), dim=-1).gather(1, tokens[index, None])[:, 0]
    return tokens, chosen


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    """Row numbers as an index on the device, copied without waiting for the GPU (a Python list as an index
    is a blocking copy: it would wait for a step launched ahead)."""
    index = torch.tensor(rows, dtype=torch.long)
    return index.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else index


def read_tokens(tokens: torch.Tensor, chosen: torch.Tensor | None,
                want_logprobs: list[bool]) -> tuple[list[int], list[float | None]]:
    """draw_tokens' tensors (on any device, or their host copies) as lists: a log-probability per row,
    None where it was not asked for."""
    logprobs: list[float | None] = [None] * len(want_logprobs)
    rows = [i for i, want in enumerate(want_logprobs) if want]
    for i, value in zip(rows, chosen.tolist() if chosen is not None else []):
        logprobs[i] = value
    return tokens.tolist(), logprobs


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           want_logprobs: list[bool]) -> tuple[list[int], list[float | None]]:
    """logits [S, V] → one token per row and, where asked, its log-probability under the model."""
    return read_tokens(*draw_tokens(logits, params, generators, want_logprobs), want_logprobs)
