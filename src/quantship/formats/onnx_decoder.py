"""The whole decoder graph: inputs and outputs in the layout ONNX Runtime GenAI and Optimum use, and
the layers streamed from the checkpoint one at a time (each layer's weights go to the data file and
are dropped before the next is read).

Inputs: input_ids [batch_size, sequence_length], attention_mask [batch_size, total_sequence_length],
position_ids [batch_size, sequence_length] (int64); per layer past_key_values.N.key/.value
[batch_size, kv_heads, past_sequence_length, head_dim] (Llama/Qwen), or past_key_values.N.latent
[batch_size, 1, past_sequence_length, kv_lora_rank + qk_rope_head_dim] (DeepSeek MLA, the latent
only). Outputs: logits [batch_size, sequence_length, vocab_size] (float32) and present.N.* with
total_sequence_length. The first call passes pasts of length 0.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from onnx import TensorProto

from quantship.formats.onnx_graph import Graph
from quantship.formats.onnx_layers import Ctx, attention_bias, gqa_attention, mla_attention, mlp, rms_norm, rope_tables
from quantship.formats.onnx_moe import moe
from quantship.formats.onnx_weights import Encoder, LayerWeights, read_layer
from quantship.models.config import ModelConfig
from quantship.models.loader import Checkpoint

INT64 = TensorProto.INT64
B, S, T, P = "batch_size", "sequence_length", "total_sequence_length", "past_sequence_length"


def cache_names(config: ModelConfig) -> list[str]:
    """The per-layer cache tensors' suffixes: (key, value), or the MLA latent alone."""
    return ["latent"] if config.is_mla else ["key", "value"]


def cache_shape(config: ModelConfig, length: str | int) -> list:
    if config.is_mla:
        return [B, 1, length, config.kv_lora_rank + config.qk_rope_head_dim]
    return [B, config.num_key_value_heads, length, config.llama_head_dim]


def build_decoder(ck: Checkpoint, g: Graph, dtype, encoder: Encoder, progress: Callable[[int], None] | None = None):
    c = ck.config
    ctx = Ctx(g, c, dtype)
    input_ids = g.input("input_ids", INT64, [B, S])
    attention_mask = g.input("attention_mask", INT64, [B, T])
    position_ids = g.input("position_ids", INT64, [B, S])
    pasts = [[g.input(f"past_key_values.{i}.{n}", ctx.elem, cache_shape(c, P)) for n in cache_names(c)]
             for i in range(c.num_hidden_layers)]

    outer = ck.outer_state()
    embed = g.weight("model.embed_tokens.weight", outer["model.embed_tokens.weight"].float().numpy().astype(dtype))
    x = g.op("Gather", [embed, input_ids], "/model/embed_tokens/Gather", axis=0)
    rope_tables(ctx, position_ids)
    attention_bias(ctx, input_ids, attention_mask)

    for i in range(c.num_hidden_layers):
        state, stored = read_layer(ck, i)
        w = LayerWeights(f"model.layers.{i}", state, stored, encoder)
        x, presents = decoder_layer(ctx, x, w, i, pasts[i])
        for name, present in zip(cache_names(c), presents):
            g.output(present, f"present.{i}.{name}", ctx.elem, cache_shape(c, T))
        del state, stored, w
        if progress:
            progress(i)

    x = rms_norm(ctx, x, outer["model.norm.weight"], c.rms_norm_eps, "/model/norm")
    head = outer.get("lm_head.weight", outer["model.embed_tokens.weight"])
    logits = g.op("MatMul", [x, g.weight("lm_head.weight", head.float().t().numpy().astype(dtype))], "/lm_head/MatMul")
    g.output(ctx.to_f32(logits, "/lm_head"), "logits", TensorProto.FLOAT, [B, S, c.vocab_size])


def decoder_layer(ctx: Ctx, x: str, w: LayerWeights, i: int, past: list[str]) -> tuple[str, list[str]]:
    c, g, path = ctx.config, ctx.g, f"/model/layers.{i}"
    h = rms_norm(ctx, x, w.tensor("input_layernorm.weight"), c.rms_norm_eps, f"{path}/input_layernorm")
    attn = w.scoped("self_attn.")
    if c.is_mla:
        out, present = mla_attention(ctx, h, attn, f"{path}/self_attn", past[0])
        presents = [present]
    else:
        out, k, v = gqa_attention(ctx, h, attn, f"{path}/self_attn", past[0], past[1])
        presents = [k, v]
    x = g.op("Add", [x, out], f"{path}/attn_residual")
    h = rms_norm(ctx, x, w.tensor("post_attention_layernorm.weight"), c.rms_norm_eps,
                 f"{path}/post_attention_layernorm")
    out = moe(ctx, h, w, f"{path}/mlp") if c.is_moe_layer(i) else mlp(ctx, h, w, "mlp.", f"{path}/mlp")
    return g.op("Add", [x, out], f"{path}/mlp_residual"), presents


def empty_cache(config: ModelConfig, batch: int, dtype=np.float32) -> dict[str, np.ndarray]:
    """The past inputs of a first call: every cache tensor with 0 past tokens."""
    shape = [batch if d == B else d for d in cache_shape(config, 0)]
    return {f"past_key_values.{i}.{n}": np.zeros(shape, dtype=dtype)
            for i in range(config.num_hidden_layers) for n in cache_names(config)}
