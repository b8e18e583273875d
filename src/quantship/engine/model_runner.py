"""Owns the model and its paged cache; runs one step of packed tokens and returns next-token logits."""

from __future__ import annotations

import torch

from quantship.engine.sequence import Sequence
from quantship.models.causal_lm import CausalLM
from quantship.models.paged import PagedBatch, cache_width


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int):
        self.model = model
        self.block_size = block_size
        first = next(model.parameters())
        self.device, self.dtype = first.device, model.model.embed_tokens.weight.dtype
        width = cache_width(model.config)
        self.kv = [torch.zeros(num_blocks * block_size, width, dtype=self.dtype, device=self.device)
                   for _ in model.model.layers]

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Sequence, int]]) -> tuple[list[Sequence], torch.Tensor | None]:
        """Compute the scheduled tokens; logits [S', V] for the sequences whose chunk reached their end."""
        starts = [seq.num_computed for seq, _ in scheduled]
        counts = [count for _, count in scheduled]
        ids = [t for (seq, count), start in zip(scheduled, starts) for t in seq.token_ids[start:start + count]]
        batch, positions = PagedBatch.build(self.kv, [seq.block_table for seq, _ in scheduled], starts, counts,
                                            self.block_size, self.device)
        hidden = self.model.hidden_states(torch.tensor([ids], device=self.device), positions, batch)[0]
        ends = torch.tensor(counts).cumsum(0) - 1
        done = [i for i, (seq, count) in enumerate(scheduled) if seq.num_computed + count == seq.num_tokens]
        if not done:
            return [], None
        logits = self.model.lm_head(hidden[ends[done].to(self.device)])
        return [scheduled[i][0] for i in done], logits
