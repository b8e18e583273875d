"""DeepSeek-V2/V3: multi-head latent attention (MLA) and the routed mixture of experts."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from quantship.kernels import KERNEL_DTYPES, elementwise, on_gpu_kernel
from quantship.kernels.fused_moe import ExpertWeights, fused_moe, reference
from quantship.kernels.routing import Routing, reference_route, route
from quantship.models import layers
from quantship.models.config import ModelConfig
from quantship.models.layers import MLP, ContiguousCache, DecoderLayer, RMSNorm, RotaryEmbedding, SharedInput, attend
from quantship.models.paged import PagedBatch, dense_weight
from quantship.models.quantized import PackedLinear

# Most attention scores (elements) one prefill SDPA call of MLA may hold; see latent_attention.
SCORES_BUDGET = 1 << 28


class MLAttention(nn.Module, SharedInput):
    """MLA: keys and values are rebuilt from a small latent c_kv (kv_lora_rank) plus a shared rope key.

    What a cache must keep per token is only (c_kv, k_rope): kv_lora_rank + qk_rope_head_dim numbers.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.heads, self.nope, self.rope_dim, self.v_dim = (
            c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        )
        self.kv_lora_rank, self.q_lora_rank = c.kv_lora_rank, c.q_lora_rank
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

    def input_names(self) -> tuple[str, ...]:
        """The Linears reading the layer's input: the queries' first projection and the latent's."""
        return ("q_proj" if self.q_lora_rank is None else "q_a_proj"), "kv_a_proj_with_mqa"

    def queries(self, first: torch.Tensor) -> torch.Tensor:
        """All heads' queries from the first projection's output (q_proj's, or q_a_proj's latent)."""
        return first if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(first))

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cache: ContiguousCache | None = None, index: int = 0
    ) -> torch.Tensor:
        b, t, _ = x.shape
        cos, sin = self.rotary.cos_sin(positions)
        first, latent = self.project(x)
        q = self.queries(first).reshape(b, t, self.heads, -1).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        q = torch.cat((q_nope, self.rotary(q_rope, cos, sin)), dim=-1)

        c_kv, k_rope = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
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
        first, latent = self.project(x)
        q_nope, q_rope = self.queries(first).reshape(n, self.heads, -1).split([self.nope, self.rope_dim], dim=-1)
        self.write_latent(latent, cos, sin, batch, index)

        w = dense_weight(self.kv_b_proj, x.dtype).view(self.heads, self.nope + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w.split([self.nope, self.v_dim], dim=1)
        q_latent = torch.einsum("nhd,hdr->nhr", q_nope, w_uk)
        if batch.takes_latent_decode(q_latent, self.kv_lora_rank, self.rope_dim):  # q's rope in the kernel
            out = batch.latent_decode_attention(index, q_latent, self.kv_lora_rank, self.scale,
                                                rope=(q_rope, cos, sin, self.rotary.interleaved))
        else:
            q_rope = self.rotary(q_rope.transpose(0, 1), cos, sin).transpose(0, 1)
            q = torch.cat((q_latent, q_rope), dim=-1)  # [N, H, rank + rope]
            out = batch.each(q, lambda q, part: self.paged_latent_attention(q, part, index))
        out = torch.einsum("nhr,hvr->nhv", out, w_uv).reshape(n, -1)
        return self.o_proj(out)[None]

    def write_latent(self, latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: PagedBatch,
                     index: int) -> None:
        """The cache entries of this step's tokens: the latent c_kv normalized ‖ k_rope rotated; on the GPU
        one kernel (the norm, the rotation, the concatenation and the write each one otherwise)."""
        norm, kv = self.kv_a_layernorm, batch.kv[index]
        if layers.use_fused_ops(latent) and elementwise.latent_write_supports(latent, norm.weight, cos, sin, kv):
            elementwise.latent_write(latent, norm.weight, norm.eps, cos, sin, self.rotary.interleaved, kv, batch.slots)
            return
        c_kv, k_rope = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        batch.write(index, torch.cat((norm(c_kv), self.rotary(k_rope, cos, sin)), dim=-1))

    def paged_latent_attention(self, q: torch.Tensor, batch: PagedBatch, index: int) -> torch.Tensor:
        """Absorbed queries [n, H, rank + rope] → [n, H, rank]: the decode kernel where it runs."""
        out = batch.latent_decode_attention(index, q, self.kv_lora_rank, self.scale)
        return out if out is not None else self.latent_attention(q, batch, index)

    def latent_attention(self, q: torch.Tensor, batch: PagedBatch, index: int) -> torch.Tensor:
        """Absorbed queries [N, H, rank + rope] over each sequence's gathered latent context → [N, H, rank]
        (prefill chunks and steps the decode kernel does not take).

        The latent width (576 for V2/V3) is beyond the fused SDPA kernels, so SDPA computes the scores
        [S, H, Q, K] whole: heads go in chunks that keep them within SCORES_BUDGET elements (a 512-token
        chunk of a 32K prompt with 128 heads would otherwise need 8 GB of float32 scores per layer)."""
        q = batch.pad(q).transpose(1, 2)  # [S, H, Q, rank + rope]
        context = batch.context(index).to(q.dtype)  # [S, K, rank + rope]: one "head" shared by all
        s, _, queries, _ = q.shape
        step = max(1, SCORES_BUDGET // (s * queries * context.shape[1]))
        parts = []
        for h in range(0, self.heads, step):
            heads = min(step, self.heads - h)
            parts.append(batch.shared_attention(q[:, h:h + heads], context, self.kv_lora_rank, self.scale))
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return batch.unpad(out.transpose(1, 2))


class Router(nn.Module):
    """Scores experts and picks top-k: V2 softmax (greedy / group-limited), V3 sigmoid with bias (noaux_tc)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.weight = nn.Parameter(torch.zeros(c.n_routed_experts, c.hidden_size))
        if c.topk_method == "noaux_tc":
            self.register_buffer("e_score_correction_bias", torch.zeros(c.n_routed_experts))
        self.routing = Routing(c.num_experts_per_tok, c.topk_method, c.scoring_func, c.n_group or 1, c.topk_group or 1,
                               c.routed_scaling_factor, c.norm_topk_prob)
        self.weight_f32: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] → (weights [N, k] float32, expert indices [N, k])."""
        weight = self.weight_f32 if self.weight_f32 is not None else self.weight.float()
        logits = F.linear(x.float(), weight)
        bias = getattr(self, "e_score_correction_bias", None)
        if on_gpu_kernel(x):
            return route(logits, bias, self.routing)
        return reference_route(logits, bias, self.routing)

    def hold_float32_weight(self) -> None:
        """Keep a float32 copy of the router's weight (the serving engine, on CUDA): the logits are float32,
        and widening a bf16 weight every step is one more kernel per layer."""
        if self.weight.dtype != torch.float32:
            self.weight_f32 = self.weight.detach().float()


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
        # The stacked experts once the serving engine turned the fused kernels on (CUDA); the quantizer
        # never does, since its calibration hooks must see every expert's own Linear run.
        self.fused: tuple[ExpertWeights, ExpertWeights, ExpertWeights] | None = None
        # How many pieces of the shared experts the stacks hold after the routed experts (fold_shared).
        self.folded_shared = 0
        # Routed token slots per expert, counted on the device only when asked (serve --expert-stats).
        self.expert_tokens: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, indices = self.gate(flat)
        if self.expert_tokens is not None:  # index_add_, not bincount: no host sync
            chosen = indices[:, :self.gate.routing.top_k].flatten()  # folded shared slots are not counted
            self.expert_tokens.index_add_(0, chosen, torch.ones_like(chosen))
        out = self.routed(flat, weights, indices)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(shape)

    def routed(self, flat: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The routed experts' sum (with the shared experts' where they are folded into the stacks)."""
        if self.fused is not None and on_gpu_kernel(flat) and self.use_kernels:
            return fused_moe(flat, *self.fused, weights, indices, shared=self.folded_shared)
        if self.folded_shared:  # the shared experts live in the stacks only now
            return reference(flat, *self.fused, weights, indices).to(flat.dtype)
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
        """Whether the fused kernels take these experts: all plain bias-free Linears, or all packed
        W4A16/W8A16 with one scheme for gate and up and one for down (any group size: a K tile that
        spans groups gathers its scales per word row)."""
        projections = [[getattr(e, name) for e in self.experts] for name in ("gate_proj", "up_proj", "down_proj")]
        linears = [m for group in projections for m in group]
        if all(type(m) is nn.Linear and m.bias is None for m in linears):
            return linears[0].weight.dtype in KERNEL_DTYPES
        if not all(isinstance(m, PackedLinear) and m.bias is None for m in linears):
            return False
        schemes = [{(m.bits, m.group_size, m.weight_zero_point is not None) for m in group} for group in projections]
        return all(len(s) == 1 for s in schemes) and schemes[0] == schemes[1]

    fold_shared = True  # enable_fused_kernels' default (benchmarks turn it off to compare)
    use_kernels = True  # False: CUDA loops over the experts too, dequantized (the reference of comparisons)

    def enable_fused_kernels(self, fold_shared: bool | None = None) -> bool:
        """Stack the experts for the fused kernels (the serving engine calls this on CUDA). Each expert's
        Linear then holds a view into the stack: no memory beyond the layer being stacked.

        fold_shared: the shared experts, cut into pieces of a routed expert's width, join the stacks
        after the routed experts and the router appends a slot of weight 1 per piece to every token,
        so they run in the same two launches and sum in the same kernel; this saves a dense MLP's
        three launches and an addition per layer, which decode steps of small batches are bound by.
        Their own Linears are dropped (the stacks hold them; buffers keep them in the weight count)."""
        if self.fused is None and self.fusable():
            fold = self.fold_shared if fold_shared is None else fold_shared
            pieces = self._shared_pieces() if fold else None
            self.fused = tuple(self._stack(name, pieces) for name in ("gate_proj", "up_proj", "down_proj"))
            if pieces:
                self.folded_shared = len(pieces["down_proj"])
                self.gate.routing = replace(self.gate.routing, shared=self.folded_shared)
                self.shared_experts = None
            self.gate.hold_float32_weight()
        return self.fused is not None

    def foldable_shared(self) -> int:
        """How many pieces of the shared experts enable_fused_kernels would fold into the stacks (0: none)."""
        pieces = self._shared_pieces() if self.fusable() else None
        return len(pieces["down_proj"]) if pieces else 0

    def _shared_pieces(self) -> dict[str, list[dict[str, torch.Tensor]]] | None:
        """The shared experts' gate, up and down cut into pieces of a routed expert's width, each as the
        tensors one expert's Linear holds (attribute name → view), or None where they do not cut:
        another scheme or dtype than the routed experts, or pieces that would split words or groups."""
        mlp, first = self.shared_experts, self.experts[0]
        if mlp is None:
            return None
        width, inter = mlp.down_proj.in_features, first.gate_proj.out_features
        if width % inter:
            return None
        merged = getattr(mlp, "merged", None)  # the engine merges gate and up before it fuses
        sources = {"gate_proj": (merged.linear, 0) if merged else (mlp.gate_proj, 0),
                   "up_proj": (merged.linear, merged.sizes[0]) if merged else (mlp.up_proj, 0),
                   "down_proj": (mlp.down_proj, 0)}
        pieces = {}
        for name, (linear, offset) in sources.items():
            along_inputs = name == "down_proj"
            cut = [_piece(linear, getattr(first, name), offset + j * inter, inter, along_inputs)
                   for j in range(width // inter)]
            if any(p is None for p in cut):
                return None
            pieces[name] = cut
        return pieces

    def _stack(self, name: str, shared: dict[str, list[dict[str, torch.Tensor]]] | None = None) -> ExpertWeights:
        linears = [getattr(e, name) for e in self.experts]
        pieces = shared[name] if shared else []
        first = linears[0]
        if type(first) is nn.Linear:
            fields = {"weight": "weight"}
            out = ExpertWeights(None, first.in_features)
        else:
            fields = {"weight": "weight_packed", "scale": "weight_scale", "zero": "weight_zero_point"}
            out = ExpertWeights(None, first.in_features, bits=first.bits, group_size=first.group_size)
        for field, attr in fields.items():
            if getattr(first, attr) is None:
                continue
            stacked = torch.stack([getattr(m, attr).data for m in linears] + [p[attr] for p in pieces])
            for i, m in enumerate(linears):
                getattr(m, attr).data = stacked[i]
            if pieces:  # the folded shared experts, held by the stack alone: counted with the model's weights
                self.register_buffer(f"shared_{name}_{attr}", stacked[len(linears):], persistent=False)
            setattr(out, field, stacked)
        return out


def _piece(linear: nn.Module, like: nn.Module, start: int, size: int, along_inputs: bool) -> dict | None:
    """Outputs (or inputs) start .. start + size of a shared expert's Linear as the tensors a routed expert's
    Linear `like` holds, in its layout; None where the two differ in kind, dtype or scheme, or the cut
    would split a packed word or a quantization group."""
    if type(linear) is not type(like) or linear.bias is not None:
        return None
    if type(linear) is nn.Linear:
        if linear.weight.dtype != like.weight.dtype:
            return None
        w = linear.weight.data
        return {"weight": w[:, start:start + size] if along_inputs else w[start:start + size]}
    if not isinstance(linear, PackedLinear) or (linear.bits, linear.weight_scale.dtype) != (
            like.bits, like.weight_scale.dtype) or (linear.weight_zero_point is None) != (like.weight_zero_point is None):
        return None
    tensors = {"weight_packed": linear.weight_packed, "weight_scale": linear.weight_scale,
               "weight_zero_point": linear.weight_zero_point}
    if not along_inputs:  # the kernel layout holds an output per column: packed [K/P, N], scales [G, N]
        if linear.group_size != like.group_size:
            return None
        return {k: None if t is None else t[:, start:start + size] for k, t in tensors.items()}
    per_word, group = 32 // linear.bits, linear.group_size
    if group != like.group_size or start % group or size % group or start % per_word or size % per_word:
        return None

    def rows(t: torch.Tensor | None, unit: int) -> torch.Tensor | None:  # packed [K/P, N], scales [K/group, N]
        return None if t is None else t[start // unit:(start + size) // unit]

    return {"weight_packed": rows(linear.weight_packed, per_word), "weight_scale": rows(linear.weight_scale, group),
            "weight_zero_point": rows(linear.weight_zero_point, group)}


def deepseek_layer(config: ModelConfig, index: int) -> DecoderLayer:
    c = config
    mlp = MoE(c) if c.is_moe_layer(index) else MLP(c.hidden_size, c.intermediate_size)
    return DecoderLayer(c, MLAttention(c), mlp)
