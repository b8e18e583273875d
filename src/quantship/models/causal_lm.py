"""The whole causal LM. Attribute names mirror the checkpoint (model.layers.N..., lm_head) so the
state dict round-trips with Hugging Face files without a renaming table."""

from __future__ import annotations

import torch
from torch import nn

from quantship.kernels import elementwise
from quantship.models import layers as layer_parts
from quantship.models.config import LLAMA, QWEN2, QWEN3, ModelConfig
from quantship.models.deepseek import deepseek_layer
from quantship.models.layers import ContiguousCache, DecoderLayer, RMSNorm, embedding
from quantship.models.llama import llama_layer
from quantship.models.qwen import qwen_layer

LAYER_BUILDERS = {LLAMA: llama_layer, QWEN2: qwen_layer, QWEN3: qwen_layer}


def build_layer(config: ModelConfig, index: int) -> DecoderLayer:
    """One decoder layer, alone: what the quantizer streams through."""
    return LAYER_BUILDERS.get(config.architecture, deepseek_layer)(config, index)


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig, layers: list[DecoderLayer] | None = None):
        super().__init__()
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        if layers is None:
            layers = [build_layer(config, i) for i in range(config.num_hidden_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, layers: list[DecoderLayer] | None = None):
        super().__init__()
        self.config = config
        self.model = Backbone(config, layers)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, cache: ContiguousCache | None = None
    ) -> torch.Tensor:
        if positions is None:
            start = cache.length if cache is not None else 0
            positions = torch.arange(start, start + input_ids.shape[-1], device=input_ids.device)
        x = self.model.embed_tokens(input_ids)
        if layer_parts.use_fused_ops(x):  # each residual step inside the norm after it (DecoderLayer.deferred)
            pending = None
            for i, layer in enumerate(self.model.layers):
                x, pending = layer.deferred(x, pending, positions, cache, i)
            norm = self.model.norm
            return norm(x) if pending is None else elementwise.add_rms_norm(x, pending, norm.weight, norm.eps)[1]
        for i, layer in enumerate(self.model.layers):
            x = layer(x, positions, cache, i)
        return self.model.norm(x)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, cache: ContiguousCache | None = None
    ) -> torch.Tensor:
        """input_ids [B, T] → logits [B, T, vocab]."""
        return self.lm_head(self.hidden_states(input_ids, positions, cache))

    def new_cache(self) -> ContiguousCache:
        return ContiguousCache(len(self.model.layers))
