"""Tiny random reference models built with transformers from a fixed seed (the parity oracle)."""

from __future__ import annotations

import torch

YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
        "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}

_MLA = dict(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64,
            kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
            max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=False)

CONFIGS = {
    "deepseek_v3": dict(_MLA, model_type="deepseek_v3", n_group=4, topk_group=2,
                        routed_scaling_factor=2.5, norm_topk_prob=True, rope_scaling=dict(YARN)),
    "deepseek_v3_no_q_lora": dict(_MLA, model_type="deepseek_v3", q_lora_rank=None, n_group=2,
                                  topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=False),
    "deepseek_v2_greedy": dict(_MLA, model_type="deepseek_v2", topk_method="greedy",
                               routed_scaling_factor=1.0, norm_topk_prob=False, rope_scaling=dict(YARN)),
    "deepseek_v2_group": dict(_MLA, model_type="deepseek_v2", topk_method="group_limited_greedy",
                              n_group=4, topk_group=2, routed_scaling_factor=16.0, norm_topk_prob=False),
    "llama": dict(model_type="llama", vocab_size=512, hidden_size=128, intermediate_size=256,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, rope_theta=100000.0,
                  rope_scaling={"type": "linear", "factor": 4.0}),
    # R1-Distill-Llama's shape: GQA and Llama 3.1 rope scaling (every wavelength band exercised).
    "llama3": dict(model_type="llama", vocab_size=512, hidden_size=128, intermediate_size=256,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   max_position_embeddings=256, rope_theta=500000.0,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    # R1-Distill-Qwen: q/k/v biases, GQA, tied embeddings as the 1.5B has them untied (both are read).
    "qwen2": dict(model_type="qwen2", vocab_size=512, hidden_size=128, intermediate_size=256,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, rope_theta=10000.0, use_sliding_window=False,
                  tie_word_embeddings=False),
    # R1-0528-Qwen3-8B: per-head q/k RMSNorm, head_dim given apart from hidden/heads, no biases.
    "qwen3": dict(model_type="qwen3", vocab_size=512, hidden_size=128, intermediate_size=256,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  max_position_embeddings=256, rope_theta=1000000.0, tie_word_embeddings=True),
}


def build_reference(name: str, seed: int = 0):
    """A transformers model for CONFIGS[name], weights from `seed`, router biases non-zero."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(CONFIGS[name])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name_, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name_:
                p.add_(torch.randn_like(p) * 0.1)  # norms at 1.0 would hide a missing norm
            if name_.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.5)  # biases at 0 would hide a missing bias
        for name_, b in model.named_buffers():
            if name_.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)
    return model.eval()


def save_reference(name: str, directory, seed: int = 0):
    model = build_reference(name, seed)
    model.save_pretrained(directory)
    return model
