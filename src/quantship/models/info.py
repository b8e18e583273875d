"""Facts about a checkpoint without loading its weights: parameters, experts, size, quantization."""

from __future__ import annotations

from pathlib import Path

import torch

from quantship.models.bundled import TINY_DIR, bundled_texts
from quantship.models.causal_lm import CausalLM
from quantship.models.loader import Checkpoint
from quantship.models.mtp import MTPLayer
from quantship.models.paged import cache_width, full_kv_width
from quantship.models.shards import check_shard


def parameter_counts(checkpoint: Checkpoint) -> tuple[int, int]:
    """(total, active per token). Counted on a meta-device model, so nothing is read or allocated."""
    c = checkpoint.config
    with torch.device("meta"):
        model = CausalLM(c)
    total = sum(p.numel() for p in model.parameters())
    inactive = 0
    for i, layer in enumerate(model.model.layers):
        if c.is_moe_layer(i):
            per_expert = sum(p.numel() for p in layer.mlp.experts[0].parameters())
            inactive += per_expert * (c.n_routed_experts - c.num_experts_per_tok)
    return total, total - inactive


def model_info(path: Path) -> dict:
    ck = Checkpoint(path)
    c = ck.config
    for shard in sorted(set(ck.files.values())):  # a size is only reported for weights that can be read
        check_shard(shard)
    total, active = parameter_counts(ck)
    info = {
        "path": str(ck.path.resolve()),
        "architecture": c.architecture,
        "parameters": total,
        "active_parameters": active,
        "layers": c.num_hidden_layers,
        "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size,
        "attention": "MLA" if c.is_mla else ("GQA" if c.num_key_value_heads < c.num_attention_heads else "MHA"),
        "dtype": c.torch_dtype,
        "max_position_embeddings": c.max_position_embeddings,
        "rope": {"type": c.rope.type, "factor": c.rope.factor, "theta": c.rope.theta},
        "size_bytes": ck.size_bytes(),
        "shards": len(set(ck.files.values())),
        "quantization_config": c.raw.get("quantization_config"),
        # What the serving engine caches per token (all layers, bf16), and full K/V for comparison.
        "kv_cache_bytes_per_token": cache_width(c) * c.num_hidden_layers * 2,
        "full_kv_bytes_per_token": full_kv_width(c) * c.num_hidden_layers * 2,
    }
    if c.is_mla:
        info["mla"] = {"q_lora_rank": c.q_lora_rank, "kv_lora_rank": c.kv_lora_rank,
                       "qk_nope_head_dim": c.qk_nope_head_dim, "qk_rope_head_dim": c.qk_rope_head_dim,
                       "v_head_dim": c.v_head_dim}
    if c.n_routed_experts:
        info["moe"] = {"routed_experts": c.n_routed_experts, "shared_experts": c.n_shared_experts,
                       "experts_per_token": c.num_experts_per_tok, "dense_layers": c.first_k_dense_replace,
                       "moe_layers": sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers)),
                       "scoring": c.scoring_func, "topk_method": c.topk_method,
                       "n_group": c.n_group, "topk_group": c.topk_group}
    if c.num_nextn_predict_layers or ck.mtp_indices:
        with torch.device("meta"):
            per_layer = sum(p.numel() for p in MTPLayer(c, c.num_hidden_layers).parameters())
        # Not in `parameters`: verify and the engine run the main model; vLLM drafts with these.
        info["mtp"] = {"declared": c.num_nextn_predict_layers, "layers": ck.mtp_indices,
                       "parameters": per_layer * len(ck.mtp_indices)}
    if ck.fp8_source is not None:
        # Read as-is: every command dequantizes it layer by layer, so no bf16 copy is ever written.
        info["fp8_block_source"] = {"weight_block_size": list(ck.fp8_source.block),
                                    "fp8_linears": sum(n.endswith(".weight_scale_inv") for n in ck.files)}
    if ck.path.resolve() == TINY_DIR.resolve():
        info.update({k: str(v) for k, v in bundled_texts().items()})
    return info
