"""ModelConfig: the fields of a real config.json that our model definition needs, validated.

Reads the configs of DeepSeek-V3/R1, DeepSeek-V2/V2-Lite, the Llama-architecture DeepSeek-Coder and
R1-Distill-Llama, and the Qwen2/Qwen3 R1 distills as published, and the `rope_parameters` spelling
that transformers 5 writes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from quantship.errors import QuantshipError

DEEPSEEK_V3 = "DeepseekV3ForCausalLM"
DEEPSEEK_V2 = "DeepseekV2ForCausalLM"
LLAMA = "LlamaForCausalLM"
QWEN2 = "Qwen2ForCausalLM"
QWEN3 = "Qwen3ForCausalLM"
GQA_ARCHITECTURES = (LLAMA, QWEN2, QWEN3)  # full K/V attention, dense MLP: the llama.py path
SUPPORTED_ARCHITECTURES = (DEEPSEEK_V3, DEEPSEEK_V2, *GQA_ARCHITECTURES)
SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    head_dim: int | None = None  # Llama and Qwen only
    rope: RopeConfig = field(default_factory=RopeConfig)
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # MLA (DeepSeek-V2/V3)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True
    # MoE (DeepSeek-V2/V3)
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False
    n_group: int | None = None
    topk_group: int | None = None
    topk_method: str = "greedy"
    scoring_func: str = "softmax"
    num_nextn_predict_layers: int = 0  # MTP layers stored after the main ones (DeepSeek-V3/R1)
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_mla(self) -> bool:
        return self.architecture in (DEEPSEEK_V2, DEEPSEEK_V3)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def llama_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim if self.is_mla else self.llama_head_dim

    def is_moe_layer(self, index: int) -> bool:
        return (
            self.is_mla
            and self.n_routed_experts > 0
            and index >= self.first_k_dense_replace
            and index % max(self.moe_layer_freq, 1) == 0
        )

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(d), times YaRN's mscale² for DeepSeek (their reference code does this)."""
        head = self.qk_head_dim if self.is_mla else self.llama_head_dim
        scale = head**-0.5
        if self.is_mla and self.rope.type == "yarn" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope_from(raw: dict, source: Path) -> RopeConfig:
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise QuantshipError("rope_scaling/rope_parameters must be an object", source)
    spec = {**params, **scaling}
    theta = float(spec.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = spec.get("rope_type", spec.get("type", "default")) or "default"
    if kind not in SUPPORTED_ROPE_TYPES:
        raise QuantshipError(
            f"rope type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})", source
        )
    if kind == "default":
        return RopeConfig(theta=theta)
    original = spec.get("original_max_position_embeddings")
    factor = spec.get("factor")
    if factor is None and kind == "yarn" and original:
        factor = raw["max_position_embeddings"] / original
    if factor is None:
        raise QuantshipError(f"rope type {kind!r} needs a 'factor'", source)
    if kind in ("yarn", "llama3") and not original:
        raise QuantshipError(f"{kind} rope scaling needs 'original_max_position_embeddings'", source)
    return RopeConfig(
        theta=theta,
        type=kind,
        factor=float(factor),
        original_max_position_embeddings=original,
        beta_fast=float(spec.get("beta_fast") or 32),
        beta_slow=float(spec.get("beta_slow") or 1),
        mscale=spec.get("mscale"),
        mscale_all_dim=spec.get("mscale_all_dim"),
        attention_factor=spec.get("attention_factor"),
        truncate=bool(spec.get("truncate", True)),
        low_freq_factor=float(spec.get("low_freq_factor") or 1.0),
        high_freq_factor=float(spec.get("high_freq_factor") or 4.0),
    )


_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings")
_MLA_REQUIRED = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def config_from_dict(raw: dict, source: Path | str = "config.json") -> ModelConfig:
    source = Path(source)
    if not isinstance(raw, dict):
        raise QuantshipError("config.json must hold a JSON object", source)
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        named = ", ".join(archs) if archs else "none named"
        raise QuantshipError(
            f"unsupported architecture ({named}); quantship supports {', '.join(SUPPORTED_ARCHITECTURES)}", source
        )
    required = _REQUIRED + (_MLA_REQUIRED if arch not in GQA_ARCHITECTURES else ())
    missing = [k for k in required if raw.get(k) is None]
    if missing:
        raise QuantshipError(f"missing field(s) {', '.join(missing)} for {arch}", source)
    if raw.get("use_sliding_window") or "sliding_attention" in (raw.get("layer_types") or []):
        # The R1 distills ship with use_sliding_window false; windowed layers would need their own mask.
        raise QuantshipError("sliding-window attention (use_sliding_window) is not supported", source)
    if raw.get("hidden_act", "silu") != "silu":
        raise QuantshipError(f"hidden_act {raw['hidden_act']!r} is not supported (only silu)", source)
    known = {f.name for f in fields(ModelConfig)} - {"architecture", "rope", "raw"}
    values: dict[str, Any] = {k: raw[k] for k in known if raw.get(k) is not None}
    values.setdefault("num_key_value_heads", raw["num_attention_heads"])
    values.setdefault("intermediate_size", 0)
    values["torch_dtype"] = str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16")
    if arch == DEEPSEEK_V3:
        values.setdefault("scoring_func", "sigmoid")
        values.setdefault("topk_method", "noaux_tc")
    config = ModelConfig(architecture=arch, rope=_rope_from(raw, source), raw=raw, **values)
    _check(config, source)
    return config


def _check(c: ModelConfig, source: Path) -> None:
    def fail(msg: str) -> None:
        raise QuantshipError(msg, source)

    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
        value = getattr(c, name)
        if not isinstance(value, int) or value <= 0:
            fail(f"{name} must be a positive integer, got {value!r}")
    if c.num_attention_heads % c.num_key_value_heads:
        fail("num_attention_heads must be a multiple of num_key_value_heads")
    if c.n_routed_experts:
        if c.num_experts_per_tok <= 0 or c.num_experts_per_tok > c.n_routed_experts:
            fail("num_experts_per_tok must be between 1 and n_routed_experts")
        if c.scoring_func not in ("softmax", "sigmoid"):
            fail(f"scoring_func {c.scoring_func!r} is not supported")
        if c.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            fail(f"topk_method {c.topk_method!r} is not supported")
        if c.topk_method != "greedy":
            if not c.n_group or not c.topk_group or c.n_routed_experts % c.n_group:
                fail(f"n_group ({c.n_group}) must divide n_routed_experts ({c.n_routed_experts}) for {c.topk_method}")
            if c.topk_group > c.n_group:
                fail("topk_group must not exceed n_group")
            if c.topk_method == "noaux_tc" and c.n_routed_experts // c.n_group < 2:
                fail("noaux_tc routing needs at least 2 experts per group")
            if c.num_experts_per_tok > c.topk_group * (c.n_routed_experts // c.n_group):
                fail("num_experts_per_tok exceeds the experts in the selected groups")


def load_config(model_dir: Path | str) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise QuantshipError("no config.json (is this a Hugging Face model directory?)", path.parent)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise QuantshipError(f"malformed JSON: {exc}", path) from None
    return config_from_dict(raw, path)
