"""Qwen2 and Qwen3, the architectures of the DeepSeek-R1 distills (R1-Distill-Qwen-1.5B/7B/14B/32B,
R1-0528-Qwen3-8B): Llama's decoder layer and grouped-query attention with their one difference each.

Qwen2 adds biases to q/k/v (never to o_proj); Qwen3 drops the biases and normalizes q and k per
head (RMSNorm over head_dim) before rope, with head_dim given in the config.
"""

from __future__ import annotations

from quantship.models.config import QWEN2, ModelConfig
from quantship.models.layers import MLP, DecoderLayer
from quantship.models.llama import GQAttention


def qwen_layer(config: ModelConfig, index: int) -> DecoderLayer:
    c = config
    if c.architecture == QWEN2:
        attention = GQAttention(c, qkv_bias=True, o_bias=False)
    else:
        attention = GQAttention(c, qk_norm=True)
    return DecoderLayer(c, attention, MLP(c.hidden_size, c.intermediate_size, bias=c.mlp_bias))
