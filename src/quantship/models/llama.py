"""Llama architecture (DeepSeek-Coder): grouped-query attention with full K/V."""

from __future__ import annotations

import torch
from torch import nn

from quantship.models.config import ModelConfig
from quantship.models.layers import MLP, ContiguousCache, DecoderLayer, RotaryEmbedding, attend


class GQAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.llama_head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.heads * self.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=c.attention_bias)
        self.rotary = RotaryEmbedding(c)
        self.scale = c.softmax_scale

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cache: ContiguousCache | None = None, index: int = 0
    ) -> torch.Tensor:
        b, t, _ = x.shape
        cos, sin = self.rotary.cos_sin(positions)
        q = self.rotary(self.q_proj(x).view(b, t, self.heads, -1).transpose(1, 2), cos, sin)
        k = self.rotary(self.k_proj(x).view(b, t, self.kv_heads, -1).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(b, t, self.kv_heads, -1).transpose(1, 2)
        if cache is not None:
            # The cache concatenates along dim 1, so store [B, T, kv_heads, D].
            k, v = (z.transpose(1, 2) for z in cache.update(index, (k.transpose(1, 2), v.transpose(1, 2))))
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = attend(q, k, v, positions, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def llama_layer(config: ModelConfig, index: int) -> DecoderLayer:
    c = config
    return DecoderLayer(c, GQAttention(c), MLP(c.hidden_size, c.intermediate_size, bias=c.mlp_bias))
