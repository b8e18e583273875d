"""DeepSeek-V3's multi-token-prediction (MTP) layer: `num_nextn_predict_layers` of them after the main
layers (model.layers.61 in V3/R1), which vLLM uses as a draft model for speculative decoding.

Stored under model.layers.N: `embed_tokens`, `enorm`, `hnorm`, `eh_proj`, `shared_head.{norm,head}`
and a full decoder layer. quantship's verify and engine run the main model only; this module exists
so the quantizer can calibrate and quantize the layer's decoder block like any other layer.
"""

from __future__ import annotations

import torch
from torch import nn

from quantship.models.config import ModelConfig
from quantship.models.deepseek import deepseek_layer
from quantship.models.layers import DecoderLayer, RMSNorm, embedding


class SharedHead(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class MTPLayer(DecoderLayer):
    """The decoder block (this module's forward) plus what turns the main model's output into its input."""

    def __init__(self, config: ModelConfig, index: int):
        block = deepseek_layer(config, index)
        super().__init__(config, block.self_attn, block.mlp)
        c = config
        self.embed_tokens = embedding(c.vocab_size, c.hidden_size)
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.shared_head = SharedHead(c)

    def block_input(self, next_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Input of the block at position t: the embedding of token t+1 (next_ids [B, T]) beside the main
        model's final, normed hidden state at t (hidden [B, T, H]), as vLLM computes it; vLLM zeroes the
        embedding at position 0, and so do we."""
        embeds = self.embed_tokens(next_ids).to(hidden.dtype)
        embeds[:, 0] = 0
        return self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden)), dim=-1))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(self.shared_head.norm(x))
