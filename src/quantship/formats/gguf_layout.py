"""Where each of our weights goes in a GGUF file, and back: one table used by the writer and the reader.

Names come from gguf-py's own TensorNameMap (what convert_hf_to_gguf.py uses). The shape changes
llama.cpp expects, each a pure function with its inverse:
- deepseek2: kv_b_proj [H·(nope+v), rank] is split per head into attn_k_b [H, rank, nope]
  (transposed, for the absorbed MLA) and attn_v_b [H, v, rank]; routed experts are stacked into
  ffn_{gate,up,down}_exps [E, out, in]; the router's score-correction bias is exp_probs_b.bias.
- llama: q_proj and k_proj rows (and biases) are permuted per head from Hugging Face's rotate-half
  layout to the interleaved pairs llama.cpp's llama rope rotates (qwen2/qwen3 rotate halves: kept);
  llama3 rope scaling becomes rope_freqs.weight, the per-frequency divisors llama.cpp applies.
Row-only changes (split, permute, stack) apply equally to a weight, its scales and zero points, so
quantized integers keep their grid; the transpose of attn_k_b is the one change that breaks it.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import torch

from quantship.models.config import QWEN2, QWEN3, ModelConfig


@dataclass(frozen=True)
class TensorSpec:
    name: str  # GGUF name
    shape: tuple[int, ...]  # row-major (numpy) shape; GGUF's ne is this reversed
    sources: tuple[str, ...]  # our parameter names (several when experts are stacked)
    transform: str = ""  # "", "k_b", "v_b", "rope_q", "rope_k", "stack"
    heads: int = 0

    @property
    def is_matrix(self) -> bool:
        return len(self.shape) >= 2 and self.name.endswith(".weight")

    @property
    def layer(self) -> int | None:
        return int(self.name.split(".")[1]) if self.name.startswith("blk.") else None


ARCHES = {QWEN2: "qwen2", QWEN3: "qwen3"}  # others: deepseek2 (MLA) or llama


def gguf_arch(config: ModelConfig) -> str:
    return "deepseek2" if config.is_mla else ARCHES.get(config.architecture, "llama")


def _namer(config: ModelConfig):
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == gguf_arch(config))
    table = gguf.get_tensor_name_map(arch, config.num_hidden_layers)

    def name(ours: str) -> str:
        found = table.get_type_and_name(ours, try_suffixes=(".weight", ".bias"))
        if found is None:
            raise KeyError(f"gguf has no name for {ours}")
        return found[1]

    return name


def tensor_specs(config: ModelConfig, params: dict[str, tuple[int, ...]]) -> list[TensorSpec]:
    """Every GGUF tensor in file order. params: every parameter and buffer of our model → its shape."""
    c = config
    name = _namer(c)
    specs = [TensorSpec("token_embd.weight", (c.vocab_size, c.hidden_size), ("model.embed_tokens.weight",)),
             TensorSpec("output_norm.weight", (c.hidden_size,), ("model.norm.weight",))]
    if not c.tie_word_embeddings:
        specs.append(TensorSpec("output.weight", (c.vocab_size, c.hidden_size), ("lm_head.weight",)))
    if c.rope.type == "llama3":  # llama.cpp divides each rope frequency by these factors
        specs.append(TensorSpec(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", (c.rope_dim // 2,),
                                (ROPE_FREQS,)))
    for i in range(c.num_hidden_layers):
        specs += _mla_specs(c, i, name, params) if c.is_mla else _gqa_specs(c, i, name, params)
    return specs


ROPE_FREQS = "rope_freqs"  # a source computed from the config, not a parameter


def model_params(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every decoder-layer parameter and buffer of our model → its shape (layers built on the meta device)."""
    from quantship.models.causal_lm import build_layer

    out = {}
    for i in range(config.num_hidden_layers):
        with torch.device("meta"):
            layer = build_layer(config, i)
        out.update({f"model.layers.{i}.{k}": tuple(v.shape) for k, v in layer.state_dict().items()})
    return out


def rope_freq_factors(config: ModelConfig) -> torch.Tensor:
    """llama3 scaling as llama.cpp takes it: each default frequency divided by the scaled one."""
    from dataclasses import replace

    from quantship.models.layers import rope_frequencies

    base, _ = rope_frequencies(replace(config.rope, type="default"), config.rope_dim)
    scaled, _ = rope_frequencies(config.rope, config.rope_dim)
    return base / scaled


def _gqa_specs(c: ModelConfig, i: int, name, params) -> list[TensorSpec]:
    """Llama, Qwen2, Qwen3: every parameter of the layer, q/k rows paired for llama's rope."""
    p = f"model.layers.{i}."
    out = []
    order = ["input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
             "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    for module in order:
        for kind in ("weight", "bias"):
            ours = f"{p}{module}.{kind}"
            if ours not in params:
                continue
            transform, heads = "", 0
            if gguf_arch(c) == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                # Hugging Face's Llama rotates halves; llama.cpp's llama rotates pairs (qwen is NEOX: as is)
                q = module == "self_attn.q_proj"
                transform, heads = ("rope_q", c.num_attention_heads) if q else ("rope_k", c.num_key_value_heads)
            out.append(TensorSpec(name(ours), tuple(params[ours]), (ours,), transform, heads))
    return out


def _mla_specs(c: ModelConfig, i: int, name, params) -> list[TensorSpec]:
    p = f"model.layers.{i}."
    out: list[TensorSpec] = []

    def plain(ours: str) -> None:
        out.append(TensorSpec(name(p + ours), tuple(params[p + ours]), (p + ours,)))

    plain("input_layernorm.weight")
    plain("post_attention_layernorm.weight")
    if c.q_lora_rank is None:
        plain("self_attn.q_proj.weight")
    else:
        plain("self_attn.q_a_proj.weight")
        plain("self_attn.q_a_layernorm.weight")
        plain("self_attn.q_b_proj.weight")
    plain("self_attn.kv_a_proj_with_mqa.weight")
    plain("self_attn.kv_a_layernorm.weight")
    h, kv_b = c.num_attention_heads, (p + "self_attn.kv_b_proj.weight",)
    out.append(TensorSpec(name(p + "self_attn.k_b_proj.weight"), (h, c.kv_lora_rank, c.qk_nope_head_dim),
                          kv_b, "k_b", h))
    out.append(TensorSpec(name(p + "self_attn.v_b_proj.weight"), (h, c.v_head_dim, c.kv_lora_rank), kv_b, "v_b", h))
    plain("self_attn.o_proj.weight")
    if c.is_moe_layer(i):
        out += _moe_specs(c, i, name, params)
    else:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            plain(f"mlp.{proj}.weight")
    return out


def _moe_specs(c: ModelConfig, i: int, name, params) -> list[TensorSpec]:
    p = f"model.layers.{i}.mlp."
    out = [TensorSpec(name(p + "gate.weight"), (c.n_routed_experts, c.hidden_size), (p + "gate.weight",))]
    if c.topk_method == "noaux_tc":
        bias = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_EXP_PROBS_B].format(bid=i) + ".bias"
        out.append(TensorSpec(bias, (c.n_routed_experts,), (p + "gate.e_score_correction_bias",)))
    for proj in ("gate_proj", "up_proj", "down_proj"):
        experts = tuple(f"{p}experts.{e}.{proj}.weight" for e in range(c.n_routed_experts))
        rows, cols = params[experts[0]]
        out.append(TensorSpec(name(f"{p}experts.{proj}.weight"), (c.n_routed_experts, rows, cols), experts, "stack"))
    if c.n_shared_experts:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            ours = f"{p}shared_experts.{proj}.weight"
            out.append(TensorSpec(name(ours), tuple(params[ours]), (ours,)))
    return out


# --- the row transforms, both directions -------------------------------------------------------

def rope_rows(n: int, heads: int) -> torch.Tensor:
    """Row order that turns each head's rotate-half rows (first halves, then second) into pairs."""
    head_dim = n // heads
    half = torch.arange(head_dim // 2)
    per_head = torch.stack((half, half + head_dim // 2), dim=1).reshape(-1)
    return (torch.arange(heads)[:, None] * head_dim + per_head).reshape(-1)


def kv_b_rows(spec: TensorSpec, config: ModelConfig) -> torch.Tensor:
    """Rows of kv_b_proj that make attn_k_b (before its transpose) or attn_v_b, head by head."""
    nope, v = config.qk_nope_head_dim, config.v_head_dim
    start = torch.arange(spec.heads)[:, None] * (nope + v)
    within = torch.arange(nope) if spec.transform == "k_b" else nope + torch.arange(v)
    return (start + within).reshape(-1)


def forward_rows(spec: TensorSpec, config: ModelConfig, rows: int) -> torch.Tensor | None:
    """The source rows a (single-source) spec takes, in GGUF order; None for the identity."""
    if spec.transform in ("rope_q", "rope_k"):
        return rope_rows(rows, spec.heads)
    if spec.transform in ("k_b", "v_b"):
        return kv_b_rows(spec, config)
    return None


def to_gguf_layout(spec: TensorSpec, t: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """One float source tensor [out, in] → the spec's shape (the stack is done by the caller)."""
    rows = forward_rows(spec, config, t.shape[0])
    if rows is not None:
        t = t[rows]
    if spec.transform == "k_b":
        return t.reshape(spec.heads, config.qk_nope_head_dim, -1).transpose(1, 2).contiguous()
    return t.reshape(spec.shape) if spec.transform != "stack" else t


def kv_b_from_gguf(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """attn_k_b [H, rank, nope] and attn_v_b [H, v, rank] → kv_b_proj [H·(nope+v), rank]."""
    return torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(-1, k_b.shape[1]).contiguous()


def ours_from_gguf(specs: list[TensorSpec], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GGUF tensors (by GGUF name, float, GGUF layout) → our parameters (our names and layouts)."""
    out: dict[str, torch.Tensor] = {}
    k_b: dict[str, torch.Tensor] = {}
    for spec in specs:
        t = tensors[spec.name]
        if spec.transform == "stack":
            out.update(zip(spec.sources, t.unbind(0)))
        elif spec.transform == "k_b":
            k_b[spec.sources[0]] = t
        elif spec.transform == "v_b":
            out[spec.sources[0]] = kv_b_from_gguf(k_b.pop(spec.sources[0]), t)
        else:
            out[spec.sources[0]] = rows_from_gguf(spec, t)
    return out


def rows_from_gguf(spec: TensorSpec, t: torch.Tensor) -> torch.Tensor:
    """Undo a rope permutation (other specs need no row change back)."""
    if spec.transform in ("rope_q", "rope_k"):
        inverse = torch.argsort(rope_rows(t.shape[0], spec.heads))
        return t[inverse]
    return t
