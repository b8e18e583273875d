"""Owns the model and its paged cache; runs one step of packed tokens and returns next-token logits."""

from __future__ import annotations

import logging

import torch

from quantship.engine import memory
from quantship.engine.cuda_graphs import DecodeGraphs, PrefillGraphs
from quantship.engine.sequence import Sequence
from quantship.models.causal_lm import CausalLM
from quantship.models.merged import merge_projections
from quantship.models.paged import PagedBatch, cache_width

log = logging.getLogger("quantship.engine")


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, cuda_graphs: bool = True,
                 max_seqs: int = 64, max_len: int = 2048, expert_stats: bool = False, prefill_graphs: bool = True):
        self.model = model
        self.block_size = block_size
        merge_projections(model)  # q/k/v and gate/up as one matmul each: fewer, longer weight reads per step
        first = next(model.parameters())
        self.device, self.dtype = first.device, model.model.embed_tokens.weight.dtype
        width = cache_width(model.config)
        # One block more than the block manager hands out: the scratch block graph padding writes into.
        self.kv = [torch.zeros((num_blocks + 1) * block_size, width, dtype=self.dtype, device=self.device)
                   for _ in model.model.layers]
        if self.device.type == "cuda":  # MoE layers route on the device through the fused kernels
            for module in model.modules():
                if hasattr(module, "enable_fused_kernels"):
                    module.enable_fused_kernels()
        self.moe_layers = {i: layer.mlp for i, layer in enumerate(model.model.layers)
                           if hasattr(layer.mlp, "expert_tokens")}
        if expert_stats:
            for moe in self.moe_layers.values():
                moe.expert_tokens = torch.zeros(len(moe.experts), dtype=torch.long, device=self.device)
        self.graphs = self.prefill_graphs = None
        if cuda_graphs and not (expert_stats and self.moe_layers) and DecodeGraphs.supported(model):
            self.graphs = DecodeGraphs(model, self.kv, block_size, num_blocks, max_seqs, max_len)
            self.prefill_graphs = PrefillGraphs(self.graphs, max_len) if prefill_graphs else None

    def expert_tokens(self) -> dict[int, list[int]] | None:
        """Tokens routed to each expert so far, by decoder layer; None unless expert_stats is on."""
        counts = {i: moe.expert_tokens for i, moe in self.moe_layers.items() if moe.expert_tokens is not None}
        return {i: c.tolist() for i, c in counts.items()} or None

    def capture_graphs(self, max_seqs: int | None = None, max_key_len: int | None = None) -> int:
        """Capture graphs before the first request: decode (DecodeGraphs.capture) and one sequence's
        chunks (PrefillGraphs.capture); 0 without them. A model whose steps cannot be captured serves
        eagerly, as in run(); running out of memory is raised."""
        if self.graphs is None:
            return 0
        added = self._graphed("graphs", lambda graphs: graphs.capture(max_seqs, max_key_len)) or 0
        if self.prefill_graphs is not None:
            added += self._graphed("prefill_graphs", lambda graphs: graphs.capture(max_key_len)) or 0
        return added

    def _graphed(self, kind: str, call):
        """call(the graphs of this kind); on a failure that is not running out of memory, that kind of step
        runs eagerly from now on (None is returned), with a warning."""
        try:
            return call(getattr(self, kind))
        except RuntimeError as error:
            if memory.out_of_memory(error):  # serving eagerly would run out at the first busy step instead
                raise torch.OutOfMemoryError(str(error)) from error
            steps = "decode steps" if kind == "graphs" else "steps of prompt chunks"
            log.warning("CUDA graph capture failed (%s); %s run eagerly", str(error).splitlines()[0], steps)
            setattr(self, kind, None)
            if kind == "graphs":  # the chunk graphs share the decode graphs' pool
                self.prefill_graphs = None
            return None

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Sequence, int]],
            tokens: torch.Tensor | None = None) -> tuple[list[Sequence], torch.Tensor | None]:
        """Compute the scheduled tokens; logits [S', V] for the sequences whose chunk reached their end.
        `tokens` [S] on the device: a decode step's input tokens, still in flight (the sequences hold
        PENDING in their place), which its graph reads on the device."""
        if self.graphs is not None and self.graphs.fits(scheduled):
            logits = self._graphed("graphs", lambda graphs: graphs.run(scheduled, tokens))
            if logits is not None:
                return [seq for seq, _ in scheduled], logits
        elif self.prefill_graphs is not None and self.prefill_graphs.fits(scheduled):
            made = self._graphed("prefill_graphs", lambda graphs: graphs.run(scheduled))
            if made is not None:
                return made
        starts = [seq.num_computed for seq, _ in scheduled]
        counts = [count for _, count in scheduled]
        ids = [t for (seq, count), start in zip(scheduled, starts) for t in seq.token_ids[start:start + count]]
        if tokens is not None:  # the graph failed: the tokens in flight come in through the host
            ids = tokens.tolist()
        batch, positions = PagedBatch.build(self.kv, [seq.block_table for seq, _ in scheduled], starts, counts,
                                            self.block_size, self.device)
        hidden = self.model.hidden_states(torch.tensor([ids], device=self.device), positions, batch)[0]
        ends = torch.tensor(counts).cumsum(0) - 1
        done = [i for i, (seq, count) in enumerate(scheduled) if seq.num_computed + count == seq.num_tokens]
        if not done:
            return [], None
        logits = self.model.lm_head(hidden[ends[done].to(self.device)])
        return [scheduled[i][0] for i in done], logits
