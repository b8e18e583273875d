"""The decoder as ONNX nodes, piece by piece, mirroring models/ (layers.py, llama.py, deepseek.py).

Each function adds the nodes of one piece and returns its output name. Shapes in comments use B
(batch), S (new tokens), P (past tokens), T = P + S. Norms, rope angles, the attention softmax and
the MoE router run in float32 whatever the graph's dtype, as our model definition does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto, helper

from quantship.formats.onnx_graph import Graph
from quantship.formats.onnx_linear import emit_linear
from quantship.models.config import ModelConfig
from quantship.models.layers import rope_frequencies

F32 = TensorProto.FLOAT
MASKED = float(np.finfo(np.float32).min)  # not -inf: a fully padded row must give a finite softmax, not NaN


@dataclass
class Ctx:
    g: Graph
    config: ModelConfig
    dtype: type  # np.float32 or np.float16: weights and hidden states
    cos: str = ""  # [B, 1, S, rope/2] in dtype
    sin: str = ""
    bias: str = ""  # [B, 1, S, T] float32: 0 where a key may be attended, MASKED elsewhere

    @property
    def elem(self) -> int:
        return helper.np_dtype_to_tensor_dtype(np.dtype(self.dtype))

    def to_f32(self, x: str, path: str) -> str:
        return x if self.dtype == np.float32 else self.g.op("Cast", [x], f"{path}/CastF32", to=F32)

    def from_f32(self, x: str, path: str) -> str:
        return x if self.dtype == np.float32 else self.g.op("Cast", [x], f"{path}/CastBack", to=self.elem)


def rope_tables(ctx: Ctx, position_ids: str) -> None:
    """cos/sin of position x inverse frequency (our rope_frequencies: default, linear, YaRN, llama3)."""
    g = ctx.g
    inv_freq, magnitude = rope_frequencies(ctx.config.rope, ctx.config.rope_dim)
    pos = g.op("Cast", [position_ids], "/model/rotary/Cast", to=F32)
    angles = g.op("Mul", [g.op("Unsqueeze", [pos, g.const([-1])], "/model/rotary/Unsqueeze"),
                          g.const(inv_freq.numpy(), np.float32)], "/model/rotary/Angles")
    for name in ("cos", "sin"):
        t = g.op(name.capitalize(), [angles], f"/model/rotary/{name.capitalize()}")
        if magnitude != 1.0:
            t = g.op("Mul", [t, g.const(np.float32(magnitude), np.float32)], f"/model/rotary/{name}_magnitude")
        t = g.op("Unsqueeze", [ctx.from_f32(t, f"/model/rotary/{name}"), g.const([1])], f"/model/rotary/{name}_4d")
        setattr(ctx, name, t)


def attention_bias(ctx: Ctx, input_ids: str, attention_mask: str) -> None:
    """Causal and padding mask as an additive bias. Query i (of S) sits at index P + i of the T keys
    the attention mask covers; it sees key j when j <= P + i and attention_mask[b, j] is 1."""
    g, p = ctx.g, "/model/attn_mask"
    s = g.op("Gather", [g.op("Shape", [input_ids], f"{p}/ShapeS"), g.const(1)], f"{p}/S")
    t = g.op("Gather", [g.op("Shape", [attention_mask], f"{p}/ShapeT"), g.const(1)], f"{p}/T")
    past = g.op("Sub", [t, s], f"{p}/P")
    queries = g.op("Range", [past, t, g.const(1)], f"{p}/QueryIndex")
    keys = g.op("Range", [g.const(0), t, g.const(1)], f"{p}/KeyIndex")
    causal = g.op("LessOrEqual", [g.op("Unsqueeze", [keys, g.const([0])], f"{p}/Keys2d"),
                                  g.op("Unsqueeze", [queries, g.const([1])], f"{p}/Queries2d")], f"{p}/Causal")
    padding = g.op("Cast", [g.op("Unsqueeze", [attention_mask, g.const([1, 2])], f"{p}/Mask4d")], f"{p}/MaskBool",
                   to=TensorProto.BOOL)
    allowed = g.op("And", [causal, padding], f"{p}/Allowed")  # [B, 1, S, T]
    ctx.bias = g.op("Where", [allowed, g.const(np.float32(0), np.float32), g.const(np.float32(MASKED), np.float32)],
                    f"{p}/Bias")


def rms_norm(ctx: Ctx, x: str, weight, eps: float, path: str) -> str:
    g = ctx.g
    xf = ctx.to_f32(x, path)
    mean = g.op("ReduceMean", [g.op("Mul", [xf, xf], f"{path}/Square")], f"{path}/ReduceMean", axes=[-1], keepdims=1)
    inv = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [mean, g.const(np.float32(eps), np.float32)], f"{path}/Eps")],
                                   f"{path}/Sqrt")], f"{path}/Rsqrt")
    y = ctx.from_f32(g.op("Mul", [xf, inv], f"{path}/Normalize"), path)
    return g.op("Mul", [g.weight(f"{path}.weight", weight.float().numpy().astype(ctx.dtype)), y], f"{path}/Mul")


def rotate(ctx: Ctx, x: str, path: str, interleaved: bool) -> str:
    """x [B, heads, S, dim] → rotated, halves layout (see RotaryEmbedding.forward)."""
    g = ctx.g
    dim = ctx.config.rope_dim
    if interleaved:  # DeepSeek: pairs (x0, x1), (x2, x3), ...
        a = g.op("Gather", [x, g.const(np.arange(0, dim, 2))], f"{path}/Even", axis=-1)
        b = g.op("Gather", [x, g.const(np.arange(1, dim, 2))], f"{path}/Odd", axis=-1)
    else:
        a, b = g.op("Split", [x], f"{path}/Split", outputs=2, axis=-1)
    first = g.op("Sub", [g.op("Mul", [a, ctx.cos], f"{path}/ACos"), g.op("Mul", [b, ctx.sin], f"{path}/BSin")],
                 f"{path}/First")
    second = g.op("Add", [g.op("Mul", [b, ctx.cos], f"{path}/BCos"), g.op("Mul", [a, ctx.sin], f"{path}/ASin")],
                  f"{path}/Second")
    return g.op("Concat", [first, second], f"{path}/Concat", axis=-1)


def heads(ctx: Ctx, x: str, count: int, size: int, path: str) -> str:
    """[B, S, count * size] → [B, count, S, size]."""
    g = ctx.g
    return g.op("Transpose", [g.op("Reshape", [x, g.const([0, 0, count, size])], f"{path}/Reshape")],
                f"{path}/Transpose", perm=[0, 2, 1, 3])


def merge_heads(ctx: Ctx, x: str, path: str) -> str:
    """[B, heads, S, size] → [B, S, heads * size]."""
    g = ctx.g
    t = g.op("Transpose", [x], f"{path}/Transpose", perm=[0, 2, 1, 3])
    return g.op("Reshape", [t, g.const([0, 0, -1])], f"{path}/Reshape")


def softmax_attend(ctx: Ctx, scores: str, values: str, bias: str, scale: float, path: str) -> str:
    """softmax(scores * scale + bias) @ values, the softmax in float32."""
    g = ctx.g
    s = g.op("Mul", [ctx.to_f32(scores, f"{path}/scores"), g.const(np.float32(scale), np.float32)], f"{path}/Scale")
    probs = g.op("Softmax", [g.op("Add", [s, bias], f"{path}/Mask")], f"{path}/Softmax", axis=-1)
    return g.op("MatMul", [ctx.from_f32(probs, f"{path}/probs"), values], f"{path}/AttnV")


def gqa_attention(ctx: Ctx, x: str, w, path: str, past_k: str, past_v: str) -> tuple[str, str, str]:
    """Llama/Qwen attention over a K/V cache [B, kv_heads, T, head_dim]; returns (out, present_k, present_v).
    Query heads are grouped [B, kv_heads, groups, S, D] so K/V broadcast instead of being repeated."""
    g, c = ctx.g, ctx.config
    h, kvh, d = c.num_attention_heads, c.num_key_value_heads, c.llama_head_dim
    q = heads(ctx, emit_linear(g, x, f"{path}/q_proj", w.linear("q_proj"), ctx.dtype), h, d, f"{path}/q")
    k = heads(ctx, emit_linear(g, x, f"{path}/k_proj", w.linear("k_proj"), ctx.dtype), kvh, d, f"{path}/k")
    v = heads(ctx, emit_linear(g, x, f"{path}/v_proj", w.linear("v_proj"), ctx.dtype), kvh, d, f"{path}/v")
    if w.has("q_norm.weight"):  # Qwen3: per-head RMSNorm on q and k before rope
        q = rms_norm(ctx, q, w.tensor("q_norm.weight"), c.rms_norm_eps, f"{path}/q_norm")
        k = rms_norm(ctx, k, w.tensor("k_norm.weight"), c.rms_norm_eps, f"{path}/k_norm")
    q, k = rotate(ctx, q, f"{path}/q_rotary", False), rotate(ctx, k, f"{path}/k_rotary", False)
    present_k = g.op("Concat", [past_k, k], f"{path}/present_key", axis=2)
    present_v = g.op("Concat", [past_v, v], f"{path}/present_value", axis=2)
    grouped = g.op("Reshape", [q, g.const([0, kvh, h // kvh, -1, d])], f"{path}/q_grouped")
    keys = g.op("Transpose", [g.op("Unsqueeze", [present_k, g.const([2])], f"{path}/k5")], f"{path}/kT",
                perm=[0, 1, 2, 4, 3])
    values = g.op("Unsqueeze", [present_v, g.const([2])], f"{path}/v5")
    bias = g.op("Unsqueeze", [ctx.bias, g.const([2])], f"{path}/bias5")
    scores = g.op("MatMul", [grouped, keys], f"{path}/QK")
    out = softmax_attend(ctx, scores, values, bias, c.softmax_scale, path)  # [B, kvh, groups, S, D]
    out = g.op("Reshape", [out, g.const([0, h, -1, d])], f"{path}/ungroup")
    out = emit_linear(g, merge_heads(ctx, out, f"{path}/merge"), f"{path}/o_proj", w.linear("o_proj"), ctx.dtype)
    return out, present_k, present_v


def mla_attention(ctx: Ctx, x: str, w, path: str, past: str) -> tuple[str, str]:
    """DeepSeek MLA over a latent cache [B, 1, T, kv_lora_rank + rope] (normalized c_kv, then the rotated
    shared rope key: vLLM's layout). K and V are rebuilt per head from the latent each step, as
    MLAttention.forward does; q·k = q_nope·k_nope + q_rope·k_rope, the rope key shared by all heads."""
    g, c = ctx.g, ctx.config
    h, nope, rope = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim
    vd, rank = c.v_head_dim, c.kv_lora_rank
    if w.has_linear("q_proj"):
        q = emit_linear(g, x, f"{path}/q_proj", w.linear("q_proj"), ctx.dtype)
    else:
        q = emit_linear(g, x, f"{path}/q_a_proj", w.linear("q_a_proj"), ctx.dtype)
        q = rms_norm(ctx, q, w.tensor("q_a_layernorm.weight"), 1e-6, f"{path}/q_a_layernorm")
        q = emit_linear(g, q, f"{path}/q_b_proj", w.linear("q_b_proj"), ctx.dtype)
    q_nope, q_rope = g.op("Split", [heads(ctx, q, h, nope + rope, f"{path}/q"), g.const([nope, rope])],
                          f"{path}/q_split", outputs=2, axis=-1)
    q_rope = rotate(ctx, q_rope, f"{path}/q_rotary", c.rope_interleave)

    kv_a = emit_linear(g, x, f"{path}/kv_a_proj_with_mqa", w.linear("kv_a_proj_with_mqa"), ctx.dtype)
    c_kv, k_rope = g.op("Split", [kv_a, g.const([rank, rope])], f"{path}/kv_a_split", outputs=2, axis=-1)
    c_kv = rms_norm(ctx, c_kv, w.tensor("kv_a_layernorm.weight"), 1e-6, f"{path}/kv_a_layernorm")
    k_rope = rotate(ctx, g.op("Unsqueeze", [k_rope, g.const([1])], f"{path}/k_rope4"), f"{path}/k_rotary",
                    c.rope_interleave)
    latent = g.op("Concat", [g.op("Unsqueeze", [c_kv, g.const([1])], f"{path}/c_kv4"), k_rope], f"{path}/latent",
                  axis=-1)
    present = g.op("Concat", [past, latent], f"{path}/present_latent", axis=2)  # [B, 1, T, rank + rope]
    all_c, all_rope = g.op("Split", [present, g.const([rank, rope])], f"{path}/latent_split", outputs=2, axis=-1)
    all_c = g.op("Squeeze", [all_c, g.const([1])], f"{path}/c_kv_all")
    kv = heads(ctx, emit_linear(g, all_c, f"{path}/kv_b_proj", w.linear("kv_b_proj"), ctx.dtype), h, nope + vd,
               f"{path}/kv")
    k_nope, v = g.op("Split", [kv, g.const([nope, vd])], f"{path}/kv_split", outputs=2, axis=-1)
    scores = g.op("Add", [
        g.op("MatMul", [q_nope, g.op("Transpose", [k_nope], f"{path}/k_nopeT", perm=[0, 1, 3, 2])],
             f"{path}/QK_nope"),
        g.op("MatMul", [q_rope, g.op("Transpose", [all_rope], f"{path}/k_ropeT", perm=[0, 1, 3, 2])],
             f"{path}/QK_rope"),
    ], f"{path}/QK")
    out = softmax_attend(ctx, scores, v, ctx.bias, c.softmax_scale, path)  # [B, H, S, v]
    out = emit_linear(g, merge_heads(ctx, out, f"{path}/merge"), f"{path}/o_proj", w.linear("o_proj"), ctx.dtype)
    return out, present


def mlp(ctx: Ctx, x: str, w, prefix: str, path: str) -> str:
    """SwiGLU: down(silu(gate(x)) * up(x))."""
    g = ctx.g
    gate = emit_linear(g, x, f"{path}/gate_proj", w.linear(f"{prefix}gate_proj"), ctx.dtype)
    up = emit_linear(g, x, f"{path}/up_proj", w.linear(f"{prefix}up_proj"), ctx.dtype)
    act = g.op("Mul", [gate, g.op("Sigmoid", [gate], f"{path}/Sigmoid")], f"{path}/SiLU")
    return emit_linear(g, g.op("Mul", [act, up], f"{path}/Mul"), f"{path}/down_proj",
                       w.linear(f"{prefix}down_proj"), ctx.dtype)
