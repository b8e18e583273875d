"""The small operations between the matmuls, fused: RMSNorm (alone, or after a residual step),
SiLU(gate) * up, and rotary embedding.

In a decode step at batch 1 the matmuls read the weights at full bandwidth, and what is left is the
count of tiny kernels between them: written with plain torch ops, an RMSNorm is 7 kernels, a rotary
embedding of q or k 9, SwiGLU's product 2, about 40 of a Llama layer's ~50. Inside a CUDA graph each
still costs a few microseconds however little it computes, so a 32-layer model spends milliseconds
per step on them. Each function here is one kernel, and `reference_*` is the plain computation it
must equal (the model's own code, which runs everywhere else: CPU, float64, other shapes);
add_rms_norm's is the sum, then reference_rms_norm. latent_write is MLA's cache write: the latent's
norm, its rope key's rotation, their concatenation and the write into the cache slots, four kernels
per layer in one (reference_latent_write); kv_write is the same for Llama's keys and values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quantship.kernels import PLAIN_ROUNDING, dependent_launch


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [..., n] as [rows, n] with unit stride along n (a view where it can be): how the kernels read it."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _row_block(n: int) -> dict:
    """One program per row: the whole row in one block, more warps for wider rows."""
    import triton

    block = triton.next_power_of_2(n)
    return {"BLOCK": block, "num_warps": min(16, max(1, block // 512))}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., n] → weight * normalized x, in the dtype the plain code gives (x's and weight's promotion)."""
    from quantship.kernels._elementwise_triton import rms_norm_kernel

    n, rows = x.shape[-1], _rows(x)
    out = torch.empty(rows.shape, dtype=torch.result_type(weight, x), device=x.device)
    rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), n, eps, **_row_block(n),
                                      **dependent_launch(x))
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)) in one pass: a residual step and the norm that follows it."""
    from quantship.kernels._elementwise_triton import add_rms_norm_kernel

    n, rows, deltas = x.shape[-1], _rows(x), _rows(delta)
    total = torch.empty(rows.shape, dtype=torch.result_type(x, delta), device=x.device)
    out = torch.empty(rows.shape, dtype=torch.result_type(weight, total), device=x.device)
    add_rms_norm_kernel[(rows.shape[0],)](rows, deltas, weight, total, out, rows.stride(0), deltas.stride(0), n, eps,
                                          **_row_block(n), **dependent_launch(x))
    return total.view(x.shape), out.view(x.shape)


def reference_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def silu_mul(gate: torch.Tensor, up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """SwiGLU's product of two [..., n] tensors in one pass."""
    import triton

    from quantship.kernels._elementwise_triton import silu_mul_kernel

    n, g, u = gate.shape[-1], _rows(gate), _rows(up)
    out = torch.empty(g.shape, dtype=torch.result_type(gate, up), device=gate.device)
    silu_mul_kernel[(g.shape[0], triton.cdiv(n, block))](g, u, out, n, g.stride(0), u.stride(0), BLOCK=block,
                                                         num_warps=4, **dependent_launch(gate))
    return out.view(gate.shape)


def reference_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


def rope_supports(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """[T, d] or [A, T, d] with unit stride along d, and one cos row per position."""
    return x.dim() in (2, 3) and x.stride(-1) == 1 and cos.dim() == 2 and cos.shape[0] == x.shape[-2] \
        and cos.shape[1] * 2 == x.shape[-1] and cos.stride(-1) == 1 and sin.stride() == cos.stride()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [A, T, d] (any strides but the last) or [T, d]; cos/sin [T, d/2] → x's shape in halves layout
    (rope_supports says which inputs it takes). The result of a 3-D x is laid out [T, A, d] in memory
    (a transposed view): the paged attention transposes its heads back to [T, A, d], which is then
    contiguous, so neither the decode kernel's input nor the cache write needs a copy."""
    import triton

    from quantship.kernels._elementwise_triton import rope_kernel

    x3 = x if x.dim() == 3 else x[None]
    heads, t, d = x3.shape
    out = torch.empty(t, heads, d, dtype=x.dtype, device=x.device).transpose(0, 1)
    rope_kernel[(heads, t)](x3, cos, sin, out, d // 2, x3.stride(0), x3.stride(1), cos.stride(0), out.stride(0),
                            out.stride(1), INTERLEAVED=interleaved, BLOCK=triton.next_power_of_2(d // 2),
                            num_warps=1, **PLAIN_ROUNDING, **dependent_launch(x))
    return out if x.dim() == 3 else out[0]


def reference_latent_write(latent: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                           sin: torch.Tensor, interleaved: bool, kv: torch.Tensor, slots: torch.Tensor) -> None:
    """kv[slots] = rms_norm(latent's first `weight` numbers) ‖ rope(the rest), in kv's dtype."""
    rank = weight.shape[0]
    entries = torch.cat((reference_rms_norm(latent[:, :rank], weight, eps),
                         reference_rope(latent[:, rank:], cos, sin, interleaved)), dim=-1)
    kv[slots] = entries.to(kv.dtype)


def latent_write_supports(latent: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          kv: torch.Tensor) -> bool:
    """Rows [N, rank + rope] with unit stride along them, all in one dtype (the kernel rounds the norm
    once, to it), one cos/sin row per token, a cache row of the same width."""
    rope = latent.shape[-1] - weight.shape[0]
    return latent.dim() == 2 and latent.stride(-1) == 1 and latent.dtype == weight.dtype == kv.dtype \
        and rope > 0 and rope % 2 == 0 and kv.is_contiguous() and kv.shape[1] == latent.shape[1] and cos.dim() == 2 \
        and cos.shape == (latent.shape[0], rope // 2) and cos.stride(-1) == 1 and sin.stride() == cos.stride()


def latent_write(latent: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                 interleaved: bool, kv: torch.Tensor, slots: torch.Tensor) -> None:
    """reference_latent_write in one launch (latent_write_supports says which inputs it takes)."""
    import triton

    from quantship.kernels._elementwise_triton import latent_write_kernel

    rank, half = weight.shape[0], (latent.shape[1] - weight.shape[0]) // 2
    latent_write_kernel[(latent.shape[0],)](latent, weight, cos, sin, kv, slots, latent.stride(0), cos.stride(0),
                                            kv.shape[1], eps, RANK=rank, HALF=half, INTERLEAVED=interleaved,
                                            BLOCK_R=triton.next_power_of_2(rank),
                                            BLOCK_P=triton.next_power_of_2(half), num_warps=4,
                                            **PLAIN_ROUNDING, **dependent_launch(latent))


def reference_kv_write(k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
                       kv: torch.Tensor, slots: torch.Tensor) -> None:
    """kv[slots] = rope(k) of every K/V head ‖ v: k [N, KVH, D], v [N, KVH * D], in kv's dtype."""
    n = k.shape[0]
    rotated = reference_rope(k.transpose(0, 1), cos, sin, interleaved).transpose(0, 1)
    kv[slots] = torch.cat((rotated.reshape(n, -1), v), dim=-1).to(kv.dtype)


def kv_write_supports(k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      kv: torch.Tensor) -> bool:
    """k [N, KVH, D] and v [N, KVH * D] with unit stride along their last axis, in kv's dtype; one cos/sin
    row per token; a cache row of exactly keys and values."""
    return k.dim() == 3 and v.dim() == 2 and k.stride(-1) == 1 and v.stride(-1) == 1 \
        and k.dtype == v.dtype == kv.dtype and k.shape[-1] % 2 == 0 and kv.is_contiguous() \
        and kv.shape[1] == 2 * k.shape[1] * k.shape[2] == 2 * v.shape[1] and cos.dim() == 2 \
        and cos.shape == (k.shape[0], k.shape[2] // 2) and cos.stride(-1) == 1 and sin.stride() == cos.stride()


def kv_write(k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
             kv: torch.Tensor, slots: torch.Tensor) -> None:
    """reference_kv_write in one launch (kv_write_supports says which inputs it takes)."""
    import triton

    from quantship.kernels._elementwise_triton import kv_write_kernel

    n, heads, dim = k.shape
    kv_write_kernel[(n, heads)](k, v, cos, sin, kv, slots, k.stride(0), k.stride(1), v.stride(0), cos.stride(0),
                                kv.shape[1], KV_HEADS=heads, HALF=dim // 2, INTERLEAVED=interleaved,
                                BLOCK_P=triton.next_power_of_2(dim // 2), BLOCK_D=triton.next_power_of_2(dim),
                                num_warps=1, **PLAIN_ROUNDING, **dependent_launch(k))
