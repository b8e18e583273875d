"""Llama architecture (DeepSeek-Coder, R1-Distill-Llama): grouped-query attention with full K/V.

Qwen2/Qwen3 reuse this attention with their two differences switched on (models/qwen.py)."""

from __future__ import annotations

import torch
from torch import nn

from quantship.kernels import elementwise
from quantship.models import layers
from quantship.models.config import ModelConfig
from quantship.models.layers import MLP, ContiguousCache, DecoderLayer, RMSNorm, RotaryEmbedding, SharedInput, attend
from quantship.models.paged import PagedBatch


class GQAttention(nn.Module, SharedInput):
    """qkv_bias/o_bias default to the config's attention_bias (Llama); qk_norm adds a per-head
    RMSNorm on q and k before rope (Qwen3)."""

    def __init__(self, config: ModelConfig, qkv_bias: bool | None = None, o_bias: bool | None = None,
                 qk_norm: bool = False):
        super().__init__()
        c = config
        qkv_bias = c.attention_bias if qkv_bias is None else qkv_bias
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.llama_head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=qkv_bias)
        o_bias = c.attention_bias if o_bias is None else o_bias
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps) if qk_norm else None
        self.rotary = RotaryEmbedding(c)
        self.scale = c.softmax_scale

    def input_names(self) -> tuple[str, ...]:
        return "q_proj", "k_proj", "v_proj"

    def split_heads(self, projected: torch.Tensor, count: int, norm: RMSNorm | None) -> torch.Tensor:
        """[..., count * D] → [..., count, D], normalized per head when the model has q/k norms."""
        t = projected.unflatten(-1, (count, self.head_dim))
        return t if norm is None else norm(t)

    def expand_kv(self, t: torch.Tensor) -> torch.Tensor:
        """[B, kv_heads, T, D] → [B, heads, T, D]; a no-op (no copy) for plain multi-head attention."""
        groups = self.heads // self.kv_heads
        return t if groups == 1 else t.repeat_interleave(groups, dim=1)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cache: ContiguousCache | None = None, index: int = 0
    ) -> torch.Tensor:
        b, t, _ = x.shape
        cos, sin = self.rotary.cos_sin(positions)
        q, k, v = self.project(x)
        q = self.rotary(self.split_heads(q, self.heads, self.q_norm).transpose(1, 2), cos, sin)
        k = self.rotary(self.split_heads(k, self.kv_heads, self.k_norm).transpose(1, 2), cos, sin)
        v = v.reshape(b, t, self.kv_heads, -1).transpose(1, 2)
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
        q, k, v = self.project(x)
        q, k = self.split_heads(q, self.heads, self.q_norm), self.split_heads(k, self.kv_heads, self.k_norm)
        self.write_kv(k, v, cos, sin, batch, index)
        if batch.takes_decode(q, self.kv_heads):  # q's rotary embedding inside the decode kernel
            out = batch.decode_attention(index, q, self.kv_heads, self.scale, rope=(cos, sin, self.rotary.interleaved))
        else:
            q = self.rotary(q.transpose(0, 1), cos, sin).transpose(0, 1)
            out = batch.each(q, lambda q, part: self.paged_attention(q, part, index))
        return self.o_proj(out.reshape(n, -1))[None]

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: PagedBatch,
                 index: int) -> None:
        """The cache entries of this step's tokens, rotated keys [N, kv_heads, D] ‖ values: on the GPU one
        kernel (the keys' rotation, the concatenation and the write each one otherwise)."""
        kv = batch.kv[index]
        if layers.use_fused_ops(k) and elementwise.kv_write_supports(k, v, cos, sin, kv):
            elementwise.kv_write(k, v, cos, sin, self.rotary.interleaved, kv, batch.slots)
            return
        k = self.rotary(k.transpose(0, 1), cos, sin).transpose(0, 1)
        batch.write(index, torch.cat((k.reshape(k.shape[0], -1), v), dim=-1))

    def paged_attention(self, q: torch.Tensor, batch: PagedBatch, index: int) -> torch.Tensor:
        """Queries [n, H, D] over the cache → [n, H, D]: the decode kernel where it runs, else each
        sequence's context gathered and one masked SDPA call."""
        decoded = batch.decode_attention(index, q, self.kv_heads, self.scale)
        if decoded is not None:
            return decoded
        context = batch.context(index).to(q.dtype)  # [S, K, 2 * kv_heads * D]
        s, length = context.shape[:2]
        k, v = context.view(s, length, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        k, v = self.expand_kv(k), self.expand_kv(v)
        out = batch.attention(batch.pad(q).transpose(1, 2), k, v, self.scale)
        return batch.unpad(out.transpose(1, 2))


def llama_layer(config: ModelConfig, index: int) -> DecoderLayer:
    c = config
    return DecoderLayer(c, GQAttention(c), MLP(c.hidden_size, c.intermediate_size, bias=c.mlp_bias))
