"""The model's hyperparameters as GGUF keys (writing) and back into a config.json dict (reading).

Keys follow convert_hf_to_gguf.py for the same architectures. deepseek2 is written the way current
llama.cpp runs MLA: one shared KV head whose key is the latent plus the rope part
(key_length = kv_lora_rank + rope dims, value_length = kv_lora_rank), with the per-head sizes in
key_length_mla / value_length_mla.
"""

from __future__ import annotations

import json

import gguf
from gguf import Keys

from quantship.errors import QuantshipError
from quantship.formats.gguf_mix import FILE_TYPES
from quantship.models.config import DEEPSEEK_V2, DEEPSEEK_V3, LLAMA, QWEN2, QWEN3, ModelConfig

_FILE_TYPE_IDS = {
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M,
    "Q5_K_M": gguf.LlamaFileType.MOSTLY_Q5_K_M, "Q6_K": gguf.LlamaFileType.MOSTLY_Q6_K,
    "F16": gguf.LlamaFileType.MOSTLY_F16, "BF16": gguf.LlamaFileType.MOSTLY_BF16,
}
assert set(_FILE_TYPE_IDS) == set(FILE_TYPES)
YARN_LOG_MUL = 0.1  # DeepSeek's yarn mscale coefficient, which llama.cpp stores multiplied in
ROPE_SCALING_KEY = "quantship.rope_scaling"
GQA_ARCHES = {"llama": LLAMA, "qwen2": QWEN2, "qwen3": QWEN3}


def add_metadata(w: gguf.GGUFWriter, c: ModelConfig, name: str, file_type: str) -> None:
    w.add_name(name)
    w.add_file_type(_FILE_TYPE_IDS[file_type])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_vocab_size(c.vocab_size)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_head_count(c.num_attention_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope.theta)
    w.add_feed_forward_length(c.intermediate_size)
    _add_rope_scaling(w, c)
    if c.is_mla:
        _add_mla(w, c)
    else:
        w.add_head_count_kv(c.num_key_value_heads)
        w.add_rope_dimension_count(c.llama_head_dim)
        if c.head_dim and c.head_dim != c.hidden_size // c.num_attention_heads:
            w.add_key_length(c.head_dim)
            w.add_value_length(c.head_dim)


def _add_mla(w: gguf.GGUFWriter, c: ModelConfig) -> None:
    w.add_head_count_kv(1)
    w.add_leading_dense_block_count(c.first_k_dense_replace if c.n_routed_experts else c.num_hidden_layers)
    if c.q_lora_rank is not None:
        w.add_q_lora_rank(c.q_lora_rank)
    w.add_kv_lora_rank(c.kv_lora_rank)
    w.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
    w.add_value_length(c.kv_lora_rank)
    w.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
    w.add_value_length_mla(c.v_head_dim)
    w.add_rope_dimension_count(c.qk_rope_head_dim)
    w.add_expert_feed_forward_length(c.moe_intermediate_size or c.intermediate_size)
    if c.n_routed_experts:
        w.add_expert_count(c.n_routed_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_shared_count(c.n_shared_experts)
        w.add_expert_weights_scale(c.routed_scaling_factor)
        if c.norm_topk_prob:
            w.add_expert_weights_norm(True)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if c.scoring_func == "sigmoid"
                                 else gguf.ExpertGatingFuncType.SOFTMAX)
        if c.topk_method != "greedy" and c.n_group:
            w.add_expert_group_count(c.n_group)
            w.add_expert_group_used_count(c.topk_group)


def _add_rope_scaling(w: gguf.GGUFWriter, c: ModelConfig) -> None:
    r = c.rope
    if r.type == "llama3":
        # llama.cpp reads llama3 scaling from the rope_freqs.weight tensor; the parameters are kept
        # here too, under quantship's own key, so that reading the file back gives the same config.
        w.add_string(ROPE_SCALING_KEY, json.dumps({"rope_type": "llama3", "factor": r.factor,
                                                   "original_max_position_embeddings":
                                                       r.original_max_position_embeddings,
                                                   "low_freq_factor": r.low_freq_factor,
                                                   "high_freq_factor": r.high_freq_factor}))
    elif r.type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(r.factor)
    elif r.type == "yarn":
        if not c.is_mla:
            raise QuantshipError("YaRN rope scaling is exported for DeepSeek (deepseek2) models only")
        # llama.cpp's deepseek2 cancels yarn's magnitude in the rope and scales attention by the
        # mscale_all_dim term alone: the same as Hugging Face's only when mscale == mscale_all_dim.
        if (r.mscale or 1.0) != (r.mscale_all_dim or 1.0) and r.mscale_all_dim:
            raise QuantshipError(f"rope_scaling mscale {r.mscale} differs from mscale_all_dim {r.mscale_all_dim}; "
                                 "llama.cpp's deepseek2 cannot express that")
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(r.factor)
        w.add_rope_scaling_orig_ctx_len(r.original_max_position_embeddings)
        if r.mscale_all_dim:
            w.add_rope_scaling_yarn_log_mul(YARN_LOG_MUL * r.mscale_all_dim)


def config_from_gguf(fields: dict, has_tensor) -> dict:
    """GGUF key → value mapping (and a predicate on tensor names) → a config.json dict for config_from_dict."""
    arch = fields[Keys.General.ARCHITECTURE]

    def get(key: str, default=None):
        return fields.get(key.format(arch=arch), default)

    raw = {
        "vocab_size": get(Keys.LLM.VOCAB_SIZE) or len(fields.get(Keys.Tokenizer.LIST, [])),
        "hidden_size": get(Keys.LLM.EMBEDDING_LENGTH),
        "intermediate_size": get(Keys.LLM.FEED_FORWARD_LENGTH),
        "num_hidden_layers": get(Keys.LLM.BLOCK_COUNT),
        "num_attention_heads": get(Keys.Attention.HEAD_COUNT),
        "max_position_embeddings": get(Keys.LLM.CONTEXT_LENGTH),
        "rms_norm_eps": get(Keys.Attention.LAYERNORM_RMS_EPS, 1e-6),
        "rope_theta": get(Keys.Rope.FREQ_BASE, 10000.0),
        "tie_word_embeddings": not has_tensor("output.weight"),
        "bos_token_id": fields.get(Keys.Tokenizer.BOS_ID),
        "eos_token_id": fields.get(Keys.Tokenizer.EOS_ID),
        "hidden_act": "silu",
    }
    scaling = get(Keys.Rope.SCALING_TYPE)
    if scaling in ("linear", "yarn"):
        raw["rope_scaling"] = {"type": scaling, "factor": get(Keys.Rope.SCALING_FACTOR)}
        if scaling == "yarn":
            mscale = (get(Keys.Rope.SCALING_YARN_LOG_MUL) or YARN_LOG_MUL) / YARN_LOG_MUL
            raw["rope_scaling"].update(original_max_position_embeddings=get(Keys.Rope.SCALING_ORIG_CTX_LEN),
                                       mscale=mscale, mscale_all_dim=mscale)
    if ROPE_SCALING_KEY in fields:
        raw["rope_scaling"] = json.loads(fields[ROPE_SCALING_KEY])
    elif has_tensor("rope_freqs.weight"):
        raise QuantshipError("rope_freqs.weight without quantship.rope_scaling: llama3 rope factors from another "
                             "converter are not read back yet")
    if arch in GQA_ARCHES:
        raw.update(architectures=[GQA_ARCHES[arch]], num_key_value_heads=get(Keys.Attention.HEAD_COUNT_KV),
                   head_dim=get(Keys.Attention.KEY_LENGTH))
        return raw
    if arch != "deepseek2":
        raise QuantshipError(f"GGUF architecture {arch!r} is not supported (deepseek2, llama, qwen2, qwen3)")
    rope = get(Keys.Rope.DIMENSION_COUNT)
    experts = get(Keys.LLM.EXPERT_COUNT, 0)
    sigmoid = get(Keys.LLM.EXPERT_GATING_FUNC) == gguf.ExpertGatingFuncType.SIGMOID
    biased = has_tensor("blk.{}.exp_probs_b.bias".format(get(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, 0)))
    groups = get(Keys.LLM.EXPERT_GROUP_COUNT)
    raw.update(
        architectures=[DEEPSEEK_V3 if sigmoid else DEEPSEEK_V2],
        num_key_value_heads=get(Keys.Attention.HEAD_COUNT),
        q_lora_rank=get(Keys.Attention.Q_LORA_RANK), kv_lora_rank=get(Keys.Attention.KV_LORA_RANK),
        qk_rope_head_dim=rope, qk_nope_head_dim=get(Keys.Attention.KEY_LENGTH_MLA) - rope,
        v_head_dim=get(Keys.Attention.VALUE_LENGTH_MLA),
        n_routed_experts=experts, num_experts_per_tok=get(Keys.LLM.EXPERT_USED_COUNT, 0),
        n_shared_experts=get(Keys.LLM.EXPERT_SHARED_COUNT, 0),
        moe_intermediate_size=get(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH),
        first_k_dense_replace=get(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, 0),
        routed_scaling_factor=get(Keys.LLM.EXPERT_WEIGHTS_SCALE, 1.0),
        norm_topk_prob=bool(get(Keys.LLM.EXPERT_WEIGHTS_NORM)),
        scoring_func="sigmoid" if sigmoid else "softmax", n_group=groups,
        topk_group=get(Keys.LLM.EXPERT_GROUP_USED_COUNT),
        topk_method="noaux_tc" if biased else ("group_limited_greedy" if groups else "greedy"),
    )
    return raw
