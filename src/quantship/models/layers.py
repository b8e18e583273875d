"""Building blocks shared by the DeepSeek and Llama layers: norm, rotary embedding, MLP, cache."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from quantship.kernels import elementwise, on_gpu_kernel
from quantship.models.config import ModelConfig, RopeConfig, yarn_mscale
from quantship.models.paged import PagedBatch


def use_fused_ops(x: torch.Tensor) -> bool:
    """Whether norms, rotary embeddings and SwiGLU products run as single Triton kernels
    (kernels/elementwise.py): on the GPU, without autograd (the kernels have no backward)."""
    return on_gpu_kernel(x) and not torch.is_grad_enabled()


class Embedding(nn.Embedding):
    """nn.Embedding that gathers 2-16 ids by indexing. nn.Embedding goes through index_select, whose CUDA
    kernel for 16 ids or fewer walks the ids one after another in each thread: 8.1 µs for a batch-16 decode
    step's 16 rows against 1.8 by indexing (H100, in a CUDA graph: benchmarks/embedding_gather.py). One row
    is faster through index_select (1.9 against 3.2 µs), 64 level. Ids must be in range, as the server and
    tokenizer give them: indexing would take a negative id from the end where index_select raises."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if 1 < ids.numel() <= 16:
            return self.weight[ids]
        return super().forward(ids)


def embedding(vocab_size: int, hidden_size: int) -> Embedding:
    """Embedding, without its random init when built on the meta device (the loader's skeleton):
    there, normal_ runs through torch's Python reference ops, whose first use imports torch._dynamo,
    2.5-4.5 s of every process that loads a model."""
    if torch.get_default_device().type == "meta":
        return Embedding(vocab_size, hidden_size, _weight=torch.empty(vocab_size, hidden_size))
    return Embedding(vocab_size, hidden_size)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused_ops(x):
            return elementwise.rms_norm(x, self.weight, self.eps)
        return elementwise.reference_rms_norm(x, self.weight, self.eps)


def rope_frequencies(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin magnitude for default, linear and YaRN rope."""
    # Explicit CPU: layers are built on the meta device, and rope tables are not weights.
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
    if rope.type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.type == "llama3":
        return llama3_frequencies(inv_freq, rope), 1.0
    if rope.type != "yarn":
        return inv_freq, 1.0
    factor = rope.factor
    if rope.attention_factor is not None:
        magnitude = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        magnitude = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
    else:
        magnitude = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        original = rope.original_max_position_embeddings
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    # Fast-rotating dimensions keep their frequency (extrapolate), slow ones are interpolated.
    keep = 1 - ramp
    inv_freq = (inv_freq / factor) * (1 - keep) + inv_freq * keep
    return inv_freq, magnitude


def llama3_frequencies(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1's scaling (R1-Distill-Llama): long wavelengths slowed by `factor`, short ones kept,
    the band between low_freq_factor and high_freq_factor blended smoothly."""
    original = rope.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    slowed = torch.where(wavelen > original / rope.low_freq_factor, inv_freq / rope.factor, inv_freq)
    smooth = (original / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * slowed / rope.factor + smooth * slowed
    medium = (wavelen >= original / rope.high_freq_factor) & (wavelen <= original / rope.low_freq_factor)
    return torch.where(medium, blended, slowed)


class RotaryEmbedding(nn.Module):
    """Rotates the rope part of q and k. No weights: built from the config alone."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        # A plain attribute, not a buffer: model.to(bfloat16) must not round the frequencies.
        self.inv_freq, self.magnitude = rope_frequencies(config.rope, config.rope_dim)
        # DeepSeek stores rope dims as interleaved pairs (x0, x1), (x2, x3)...; Llama as two halves.
        self.interleaved = config.is_mla and config.rope_interleave

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        angles = positions.float()[..., None] * self.inv_freq
        return angles.cos() * self.magnitude, angles.sin() * self.magnitude

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [..., T, dim]; cos/sin: [T, dim/2], broadcast over leading dims."""
        # Output is in halves layout either way: q and k get the same permutation, so q·k is unchanged.
        if use_fused_ops(x) and elementwise.rope_supports(x, cos, sin):
            return elementwise.rope(x, cos, sin, self.interleaved)
        return elementwise.reference_rope(x, cos, sin, self.interleaved)


class SharedInput:
    """A module some of whose Linears (input_names) read the same input. For serving, models/merged.py
    may replace them by one matmul (the attribute `merged`); project(x) gives their outputs either way."""

    def input_names(self) -> tuple[str, ...]:
        raise NotImplementedError

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        merged = getattr(self, "merged", None)
        if merged is not None:
            return merged(x)
        return tuple(getattr(self, name)(x) for name in self.input_names())


class MLP(nn.Module, SharedInput):
    """SwiGLU feed-forward: the dense MLP, each routed expert and the shared experts."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def input_names(self) -> tuple[str, ...]:
        return "gate_proj", "up_proj"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = use_fused_ops(x)
        merged, gated = getattr(self, "merged", None), getattr(self.down_proj, "gated", None)
        if fused and merged is not None and gated is not None:
            # a packed down projection makes SwiGLU's product itself where it runs its GEMV (one row)
            both = merged.linear(x)
            out = gated(both)
            if out is not None:
                return out
            gate, up = both.split(merged.sizes, dim=-1)
        else:
            gate, up = self.project(x)
        product = elementwise.silu_mul if fused else elementwise.reference_silu_mul
        return self.down_proj(product(gate, up))


class ContiguousCache:
    """Per-layer growing cache for the simple generation loop (the engine has a paged one).

    Each layer stores whatever its attention caches: the MLA latent (c_kv, k_rope) or Llama's (k, v),
    as tensors [B, T, ...] concatenated along T.
    """

    def __init__(self, num_layers: int):
        self.entries: list[tuple[torch.Tensor, ...] | None] = [None] * num_layers

    @property
    def length(self) -> int:
        first = self.entries[0]
        return 0 if first is None else first[0].shape[1]

    def update(self, layer: int, new: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        old = self.entries[layer]
        merged = new if old is None else tuple(torch.cat((o, n), dim=1) for o, n in zip(old, new))
        self.entries[layer] = merged
        return merged


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of q [B,H,Tq,D] over k,v [B,H,Tk,*] where keys sit at positions 0..Tk-1."""
    tq, tk = q.shape[-2], k.shape[-2]
    if tq == tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    mask = torch.arange(tk, device=q.device)[None, :] <= q_positions[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class DecoderLayer(nn.Module):
    """Pre-norm residual block; names match the checkpoints (input_layernorm, self_attn, ...).

    Every attention has two paths: `forward` over a contiguous cache (or none), the simple loop's and
    the quantizer's, and `forward_paged` over the engine's paged cache; the cache's kind picks one here."""

    def __init__(self, config: ModelConfig, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cache: ContiguousCache | PagedBatch | None = None,
        index: int = 0,
    ) -> torch.Tensor:
        if use_fused_ops(x):
            x, delta = self.deferred(x, None, positions, cache, index)
            return x + delta
        attended = self._attention(cache)(self.input_layernorm(x), positions, cache, index)
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x))

    def _attention(self, cache):
        return self.self_attn.forward_paged if isinstance(cache, PagedBatch) else self.self_attn

    def deferred(self, x: torch.Tensor, pending: torch.Tensor | None, positions: torch.Tensor,
                 cache: ContiguousCache | PagedBatch | None, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer through the fused kernels with its last residual step left to the caller: returns the
        residual stream before it and the MLP's output to add. `pending`, the layer before's MLP output,
        is added in this layer's input norm (each residual step is the kernel of the norm after it: a
        separate add launch fewer per layer, CausalLM.hidden_states). GPU only (use_fused_ops)."""
        norm = self.input_layernorm
        if pending is None:
            normed = norm(x)
        else:
            x, normed = elementwise.add_rms_norm(x, pending, norm.weight, norm.eps)
        attended = self._attention(cache)(normed, positions, cache, index)
        norm = self.post_attention_layernorm
        x, normed = elementwise.add_rms_norm(x, attended, norm.weight, norm.eps)
        return x, self.mlp(normed)
