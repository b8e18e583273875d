"""Llama architecture (DeepSeek-Coder): grouped-query attention with full K/V."""

from __future__ import annotations

import torch
from torch import nn

from quantship.models.config import ModelConfig
from quantship.models.layers import MLP, ContiguousCache, DecoderLayer, RotaryEmbedding, attend
from quantship.models.paged import PagedBatch


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

    def expand_kv(self, t: torch.Tensor) -> torch.Tensor:
        """[B, kv_heads, T, D] → [B, heads, T, D]; a no-op (no copy) for plain multi-head attention."""
        groups = self.heads // self.kv_heads
        return t if groups == 1 else t.repeat_interleave(groups, dim=1)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cache: ContiguousCache | PagedBatch | None = None,
        index: int = 0,
    ) -> torch.Tensor:
        if isinstance(cache, PagedBatch):
            return self.forward_paged(x, positions, cache, index)
        b, t, _ = x.shape
        cos, sin = self.rotary.cos_sin(positions)
        q = self.rotary(self.q_proj(x).view(b, t, self.heads, -1).transpose(1, 2), cos, sin)
        k = self.rotary(self.k_proj(x).view(b, t, self.kv_heads, -1).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(b, t, self.kv_heads, -1).transpose(1, 2)
        if cache is not None:
            # The cache concatenates along dim 1, so store [B, T, kv_heads, D].
            k, v = (z.transpose(1, 2) for z in cache.update(index, (k.transpose(1, 2), v.transpose(1, 2))))
        k, v = self.expand_kv(k), self.expand_kv(v)
        out = attend(q, k, v, positions, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def forward_paged(self, x: torch.Tensor, positions: torch.Tensor, batch: PagedBatch, index: int) -> torch.Tensor:
        x = x[0]  # [N, hidden]: the engine packs all sequences into one row
        n = x.shape[0]
        cos, sin = batch.cos_sin(self.rotary, positions, x.dtype)

        def heads(t: torch.Tensor, count: int) -> torch.Tensor:  # [N, count*D] → [count, N, D]
            return t.view(n, count, self.head_dim).transpose(0, 1)

        q = self.rotary(heads(self.q_proj(x), self.heads), cos, sin).transpose(0, 1)
        k = self.rotary(heads(self.k_proj(x), self.kv_heads), cos, sin).transpose(0, 1)
        batch.write(index, torch.cat((k.reshape(n, -1), self.v_proj(x)), dim=-1))
        context = batch.context(index).to(x.dtype)  # [S, K, 2 * kv_heads * D]
        s, length = context.shape[:2]
        k, v = context.view(s, length, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        k, v = self.expand_kv(k), self.expand_kv(v)
        out = batch.attention(batch.pad(q).transpose(1, 2), k, v, self.scale)
        return self.o_proj(batch.unpad(out.transpose(1, 2)).reshape(n, -1))[None]


def llama_layer(config: ModelConfig, index: int) -> DecoderLayer:
    c = config
    return DecoderLayer(c, GQAttention(c), MLP(c.hidden_size, c.intermediate_size, bias=c.mlp_bias))
