"""CUDA graphs for decode steps: one replay instead of hundreds of kernel launches.

An eager decode step of a 6.7B model spends ~45 ms of host time launching ~7 ms of GPU work. A graph
is captured per (batch size bucket, key length bucket) the first time that shape is needed; a step
pads its sequences up to the bucket with dummy rows that write into a scratch block no sequence
owns, and pads the key axis (masked). Only decode-only steps are graphed, and MoE models only where
every MoE layer takes the fused kernels (kernels/fused_moe.py: routing stays on the device); the
host loop over quantized experts reads counts on the host, which a graph cannot replay. Everything
else runs eagerly, as on CPU.
"""

from __future__ import annotations

from dataclasses import fields

import torch

from quantship.engine.sequence import Sequence
from quantship.models.causal_lm import CausalLM
from quantship.models.paged import PagedBatch

TENSOR_FIELDS = [f.name for f in fields(PagedBatch) if f.name not in ("kv", "_rope")]


def buckets(limit: int, first: int) -> list[int]:
    """first, 2*first, 4*first, ... until one reaches limit."""
    out = [first]
    while out[-1] < limit:
        out.append(out[-1] * 2)
    return out


class DecodeGraphs:
    def __init__(self, model: CausalLM, kv: list[torch.Tensor], block_size: int, scratch_block: int,
                 max_seqs: int, max_len: int):
        self.model, self.kv, self.block_size, self.scratch = model, kv, block_size, scratch_block
        self.device = kv[0].device
        self.seq_buckets = buckets(max_seqs, 1)
        self.key_buckets = buckets(max_len, max(256, block_size))
        self.graphs: dict[tuple[int, int], tuple] = {}
        self.pool = None

    @staticmethod
    def supported(model: CausalLM) -> bool:
        moe = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "enable_fused_kernels")]
        return next(model.parameters()).is_cuda and all(m.fused is not None for m in moe)

    def fits(self, scheduled: list[tuple[Sequence, int]]) -> bool:
        decode_only = all(count == 1 and seq.num_computed + 1 == seq.num_tokens for seq, count in scheduled)
        longest = max(seq.num_tokens for seq, _ in scheduled)
        return decode_only and len(scheduled) <= self.seq_buckets[-1] and longest <= self.key_buckets[-1]

    def _inputs(self, tables, starts, key_len):
        batch, positions = PagedBatch.build(self.kv, tables, starts, [1] * len(tables), self.block_size,
                                            self.device, key_len)
        return batch, positions

    def _capture(self, size: int, key_len: int) -> tuple:
        ids = torch.zeros(1, size, dtype=torch.long, device=self.device)
        batch, positions = self._inputs([[self.scratch]] * size, [0] * size, key_len)

        def forward() -> torch.Tensor:
            batch._rope = None  # recompute the rope tables inside the graph, from the static positions
            return self.model.lm_head(self.model.hidden_states(ids, positions, batch)[0])

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside the graph: lazy allocations, kernel selection
                forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = forward()
        self.pool = graph.pool()
        return graph, ids, positions, batch, logits

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Logits [S, V] of a decode-only step."""
        n = len(scheduled)
        size = next(b for b in self.seq_buckets if b >= n)
        key_len = next(b for b in self.key_buckets if b >= max(seq.num_tokens for seq, _ in scheduled))
        if (size, key_len) not in self.graphs:
            self.graphs[(size, key_len)] = self._capture(size, key_len)
        graph, ids, positions, batch, logits = self.graphs[(size, key_len)]
        pad = size - n
        tables = [seq.block_table for seq, _ in scheduled] + [[self.scratch]] * pad
        starts = [seq.num_computed for seq, _ in scheduled] + [0] * pad
        step, step_positions = self._inputs(tables, starts, key_len)
        tokens = [seq.token_ids[-1] for seq, _ in scheduled] + [0] * pad
        ids.copy_(torch.tensor([tokens]), non_blocking=True)
        positions.copy_(step_positions)
        for name in TENSOR_FIELDS:
            getattr(batch, name).copy_(getattr(step, name))
        graph.replay()
        return logits[:n]
