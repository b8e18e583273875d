"""DeepSeek-V2/V3: multi-head latent attention (MLA) and the routed mixture of experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quantship.models.config import ModelConfig
from quantship.models.layers import MLP, ContiguousCache, DecoderLayer, RMSNorm, RotaryEmbedding, attend
from quantship.models.paged import PagedBatch, dense_weight


class MLAttention(nn.Module):
    """MLA: keys and values are rebuilt from a small latent c_kv (kv_lora_rank) plus a shared rope key.

    What a cache must keep per token is only (c_kv, k_rope): kv_lora_rank + qk_rope_head_dim numbers.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.heads, self.nope, self.rope_dim, self.v_dim = (
            c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        )
        self.kv_lora_rank = c.kv_lora_rank
        qk = c.qk_head_dim
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(c.hidden_size, self.heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=c.attention_bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank)
            self.q_b_proj = nn.Linear(c.q_lora_rank, self.heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=c.attention_bias)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, self.heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * self.v_dim, c.hidden_size, bias=c.attention_bias)
        self.rotary = RotaryEmbedding(c)
        self.scale = c.softmax_scale

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cache: ContiguousCache | PagedBatch | None = None,
        index: int = 0,
    ) -> torch.Tensor:
        if isinstance(cache, PagedBatch):
            return self.forward_paged(x, positions, cache, index)
        b, t, _ = x.shape
        cos, sin = self.rotary.cos_sin(positions)
        q = self.queries(x).view(b, t, self.heads, -1).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        q = torch.cat((q_nope, self.rotary(q_rope, cos, sin)), dim=-1)

        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c_kv, k_rope = self.kv_a_layernorm(c_kv), self.rotary(k_rope, cos, sin)
        if cache is not None:
            c_kv, k_rope = cache.update(index, (c_kv, k_rope))
        s = c_kv.shape[1]
        kv = self.kv_b_proj(c_kv).view(b, s, self.heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rope[:, None].expand(b, self.heads, s, self.rope_dim)), dim=-1)
        out = attend(q, k, v, positions, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def forward_paged(self, x: torch.Tensor, positions: torch.Tensor, batch: PagedBatch, index: int) -> torch.Tensor:
        """The absorbed form over the cached latent: keys and values are never expanded per head.

        q_nope·k_nope = q_nope·(W_UK c) = (q_nope W_UK)·c, so queries move into the latent space
        (kv_lora_rank) and attend to c_kv directly; the output is lifted back per head with W_UV.
        """
        x = x[0]  # [N, hidden]: the engine packs all sequences into one row
        n = x.shape[0]
        cos, sin = batch.cos_sin(self.rotary, positions, x.dtype)
        q_nope, q_rope = self.queries(x).view(n, self.heads, -1).split([self.nope, self.rope_dim], dim=-1)
        q_rope = self.rotary(q_rope.transpose(0, 1), cos, sin).transpose(0, 1)
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        batch.write(index, torch.cat((self.kv_a_layernorm(c_kv), self.rotary(k_rope, cos, sin)), dim=-1))

        w = dense_weight(self.kv_b_proj, x.dtype).view(self.heads, self.nope + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w.split([self.nope, self.v_dim], dim=1)
        q = torch.cat((torch.einsum("nhd,hdr->nhr", q_nope, w_uk), q_rope), dim=-1)
        q = batch.pad(q).transpose(1, 2)  # [S, H, Q, rank + rope]
        context = batch.context(index).to(x.dtype)[:, None]  # [S, 1, K, rank + rope]: one "head" shared by all
        keys = context.expand(-1, self.heads, -1, -1)
        values = context[..., : self.kv_lora_rank].expand(-1, self.heads, -1, -1)
        out = batch.attention(q, keys, values, self.scale)
        out = batch.unpad(out.transpose(1, 2))  # [N, H, rank]
        out = torch.einsum("nhr,hvr->nhv", out, w_uv).reshape(n, -1)
        return self.o_proj(out)[None]


class Router(nn.Module):
    """Scores experts and picks top-k: V2 softmax (greedy / group-limited), V3 sigmoid with bias (noaux_tc)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.weight = nn.Parameter(torch.zeros(c.n_routed_experts, c.hidden_size))
        if c.topk_method == "noaux_tc":
            self.register_buffer("e_score_correction_bias", torch.zeros(c.n_routed_experts))
        self.experts, self.top_k = c.n_routed_experts, c.num_experts_per_tok
        self.method, self.scoring = c.topk_method, c.scoring_func
        self.n_group, self.topk_group = c.n_group or 1, c.topk_group or 1
        self.scaling, self.normalize = c.routed_scaling_factor, c.norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] → (weights [N, k] float32, expert indices [N, k])."""
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid() if self.scoring == "sigmoid" else logits.softmax(dim=-1)
        choice = scores
        if self.method == "noaux_tc":
            # The bias only steers which experts are chosen; weights come from the raw scores.
            choice = scores + self.e_score_correction_bias.float()
        if self.method != "greedy":
            grouped = choice.view(-1, self.n_group, self.experts // self.n_group)
            if self.method == "noaux_tc":
                group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            else:
                group_scores = grouped.max(dim=-1).values
            keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, 1)
            keep = keep.bool()[..., None].expand_as(grouped).reshape(-1, self.experts)
            choice = choice.masked_fill(~keep, float("-inf") if self.method == "noaux_tc" else 0.0)
        indices = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, indices)
        if self.normalize and self.top_k > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, indices


class MoE(nn.Module):
    """Routed experts plus always-on shared experts. Module names match the per-expert checkpoint names."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.gate = Router(c)
        self.experts = nn.ModuleList(MLP(c.hidden_size, c.moe_intermediate_size) for _ in range(c.n_routed_experts))
        self.shared_experts = (
            MLP(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts) if c.n_shared_experts else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, indices = self.gate(flat)
        out = self.routed(flat, weights, indices)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(shape)

    def routed(self, flat: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        if flat.is_cuda and self.fusable():
            from quantship.kernels.fused_moe import fused_moe

            return fused_moe(flat, *self.stacked_weights(), weights, indices)
        out = torch.zeros_like(flat)
        counts = torch.bincount(indices.flatten(), minlength=len(self.experts)).tolist()
        for e, count in enumerate(counts):
            if count == 0:
                continue
            token, slot = torch.where(indices == e)
            y = self.experts[e](flat[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


    def fusable(self) -> bool:
        """The fused kernels take plain (unquantized, bias-free) expert Linears; others keep the loop."""
        linears = [m for e in self.experts for m in (e.gate_proj, e.up_proj, e.down_proj)]
        return all(type(m) is nn.Linear and m.bias is None for m in linears)

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts' weights as gate_up [E, 2I, H] and down [E, H, I], made once. Each expert's Linears
        then hold views into them, so the stacking costs no memory beyond one layer while it runs."""
        if getattr(self, "_stacked", None) is None:
            gate_up = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in self.experts])
            down = torch.stack([e.down_proj.weight for e in self.experts])
            inter = down.shape[2]
            for i, e in enumerate(self.experts):
                e.gate_proj.weight.data, e.up_proj.weight.data = gate_up[i, :inter], gate_up[i, inter:]
                e.down_proj.weight.data = down[i]
            self._stacked = (gate_up, down)
        return self._stacked


def deepseek_layer(config: ModelConfig, index: int) -> DecoderLayer:
    c = config
    mlp = MoE(c) if c.is_moe_layer(index) else MLP(c.hidden_size, c.intermediate_size)
    return DecoderLayer(c, MLAttention(c), mlp)
