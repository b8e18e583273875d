"""Which GGUF type each tensor gets for a file type: llama.cpp's rules (src/llama-quant.cpp), restated.

Only the file types quantship writes are covered. The rules, as llama.cpp applies them:
- only 2-D/3-D tensors whose name ends in "weight" are quantized; norms and the MoE router
  (ffn_gate_inp) never are (they stay F32);
- output.weight (and token_embd when the output is tied to it) gets Q6_K, or Q8_0 when its row
  length does not divide by the base type's block or the base type is Q8_0;
- Q4_K_M / Q5_K_M give Q6_K to attn_v (and attn_qkv, attn_kv_b) and to ffn_down in the layers
  `use_more_bits` picks: the first and last eighth of the model and every third layer between;
- models with exactly 8 experts get attn_v and attn_k in Q8_0 and, for Q4_K_M, attn_output in Q5_K;
- a Llama of 80 layers with grouped KV heads ("70B") gets attn_v in Q5_K where it would be Q4_K;
- a row length that does not divide by the block size falls back: Q4_K→Q5_0, Q5_K→Q5_1, Q6_K→Q8_0,
  then F16 (llama.cpp aborts for the 32-blocks; we fall back to F16 and say so).
Tensors are visited in llama.cpp's order (by layer, then by name), which the counters depend on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gguf import GGMLQuantizationType as T

from quantship.formats.gguf_blocks import block_size

# --type → (llama.cpp's file type name, base tensor type)
FILE_TYPES: dict[str, T] = {
    "Q4_0": T.Q4_0, "Q4_1": T.Q4_1, "Q8_0": T.Q8_0, "Q4_K_M": T.Q4_K, "Q5_K_M": T.Q5_K, "Q6_K": T.Q6_K,
    "F16": T.F16, "BF16": T.BF16,
}
_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}
_LAYER = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class ModelShape:
    """What the rules look at besides tensor names."""

    arch: str  # "deepseek2", "llama", ...
    n_layer: int
    n_expert: int
    n_head: int
    n_head_kv: int


@dataclass(frozen=True)
class Choice:
    qtype: T
    fallback_from: T | None = None  # set when the row length forced a different type


def _category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name == "token_embd.weight":
        return "token_embd"
    for key in ("attn_qkv.weight", "attn_kv_b.weight", "attn_v.weight", "attn_k.weight", "attn_q.weight",
                "attn_output.weight"):
        if key in name:
            return key.split(".")[0]
    for key in ("ffn_up", "ffn_gate", "ffn_down"):
        if key in name:
            return key
    return "other"


def quantizable(name: str, n_dims: int) -> bool:
    return (n_dims >= 2 and name.endswith("weight") and "_norm.weight" not in name
            and "ffn_gate_inp.weight" not in name)


def llama_order(names: list[str]) -> list[str]:
    def key(name: str):
        m = _LAYER.match(name)
        return (int(m.group(1)) if m else -1, name)

    return sorted(names, key=key)


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def choose_types(tensors: dict[str, tuple[int, int]], file_type: str, shape: ModelShape) -> dict[str, Choice]:
    """tensors: GGUF name → (row length, number of dims), for every tensor of the file.

    Returns a Choice for every quantizable tensor; the others keep F32 (the caller's default).
    """
    base = FILE_TYPES[file_type]
    names = llama_order(list(tensors))
    tied = "output.weight" not in tensors
    n_attn_v = sum(_category(n) in ("attn_v", "attn_qkv", "attn_kv_b") for n in names)
    counters = {"attn_v": 0, "ffn_down": 0}
    out: dict[str, Choice] = {}
    for name in names:
        ncols, n_dims = tensors[name]
        if not quantizable(name, n_dims):
            continue
        if base in (T.F16, T.BF16):
            out[name] = Choice(base)
            continue
        qtype = _rule(name, _category(name), base, file_type, ncols, tied, n_attn_v, counters, shape)
        out[name] = _fit(qtype, ncols)
    return out


def _rule(name, category, base, file_type, ncols, tied, n_attn_v, counters, shape: ModelShape) -> T:
    eight_experts = shape.n_expert == 8
    if category == "output" or (tied and category == "token_embd"):
        if ncols % block_size(base) != 0 or base == T.Q8_0:
            return T.Q8_0
        return T.Q6_K
    if category == "token_embd":
        return base
    if category in ("attn_v", "attn_qkv", "attn_kv_b"):
        qtype = base
        if file_type in ("Q4_K_M", "Q5_K_M") and _use_more_bits(counters["attn_v"], n_attn_v):
            qtype = T.Q6_K
        is_70b = shape.arch == "llama" and shape.n_layer == 80 and shape.n_head != shape.n_head_kv
        if is_70b and qtype == T.Q4_K:
            qtype = T.Q5_K
        if eight_experts:
            qtype = T.Q8_0
        counters["attn_v"] += 1
        return qtype
    if category == "attn_k":
        return T.Q8_0 if eight_experts else base
    if category == "ffn_down":
        i_layer = counters["ffn_down"]
        if shape.n_expert > 1:
            i_layer = int(_LAYER.match(name).group(1))  # experts are not visited in layer order
        counters["ffn_down"] += 1
        if file_type in ("Q4_K_M", "Q5_K_M") and _use_more_bits(i_layer, shape.n_layer):
            return T.Q6_K
        return base
    if category == "attn_output" and eight_experts and file_type == "Q4_K_M":
        return T.Q5_K
    return base


def _fit(qtype: T, ncols: int) -> Choice:
    if ncols % block_size(qtype) == 0:
        return Choice(qtype)
    fallback = _FALLBACK.get(qtype, T.F16)
    if ncols % block_size(fallback) != 0:
        fallback = T.F16
    return Choice(fallback, fallback_from=qtype)
