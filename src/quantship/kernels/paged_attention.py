"""Decode attention straight from the paged cache: one query per sequence, keys read where they lie.

The general path gathers every sequence's keys and values into a padded [S, K, width] tensor per
layer (and repeats K/V heads for grouped-query attention) before one masked SDPA call. For a decode
step that copy is most of the attention's memory traffic: at batch 64 and 256 keys, a 6.7B Llama
moves about 270 MB per layer through it. Here each program takes one sequence and one K/V head
(with all the query heads that share it), walks the sequence's key slots up to its length, and keeps
an online softmax (running max and sum) in registers, so keys and values are read once and padding
beyond a sequence's length is never touched.

Cache layout (models/paged.py): one tensor per layer [num_slots, 2 * kv_heads * head_dim], a token's
keys for every K/V head, then its values. `reference` is the plain computation the kernel must equal.

MLA (DeepSeek) caches one latent entry per token, c_kv ‖ k_rope, shared by every head. In the absorbed
form the queries already live in that space ([S, H, rank + rope]), so `mla_decode_attention` is
multi-query attention whose keys are the whole entry and whose values are its first `rank` numbers:
each program takes one sequence and a block of heads and reads the entries once, with no per-layer
gather of the context and no expansion over heads; `mla_reference` is its plain form.
"""

from __future__ import annotations

import torch


def supports(head_dim: int, heads: int, kv_heads: int) -> bool:
    """Power-of-two head sizes (a Triton tile) and whole groups of query heads per K/V head."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and heads % kv_heads == 0


def reference(q: torch.Tensor, cache: torch.Tensor, key_slots: torch.Tensor, lengths: torch.Tensor, kv_heads: int,
              scale: float) -> torch.Tensor:
    """q [S, H, D], cache [slots, 2*KVH*D], key_slots [S, K], lengths [S] → [S, H, D] in float32."""
    s, heads, dim = q.shape
    out = torch.empty(s, heads, dim, dtype=torch.float32, device=q.device)
    for i in range(s):
        entries = cache[key_slots[i, :int(lengths[i])].long()].float().view(-1, 2, kv_heads, dim)
        k = entries[:, 0].repeat_interleave(heads // kv_heads, dim=1)  # [L, H, D]
        v = entries[:, 1].repeat_interleave(heads // kv_heads, dim=1)
        weights = torch.softmax(torch.einsum("hd,lhd->hl", q[i].float(), k) * scale, dim=-1)
        out[i] = torch.einsum("hl,lhd->hd", weights, v)
    return out


def decode_attention(q: torch.Tensor, cache: torch.Tensor, key_slots: torch.Tensor, lengths: torch.Tensor,
                     kv_heads: int, scale: float, block_n: int = 64) -> torch.Tensor:
    """[S, H, D] in q's dtype, through the Triton kernel."""
    import triton

    from quantship.kernels._paged_attention_triton import paged_decode_kernel

    s, heads, dim = q.shape
    group = heads // kv_heads
    q = q.contiguous()
    out = torch.empty_like(q)  # after .contiguous(): empty_like keeps a transposed q's strides
    paged_decode_kernel[(s, kv_heads)](
        q, cache, key_slots, lengths, out, key_slots.stride(0), cache.shape[1], scale,
        GROUP=group, KV_HEADS=kv_heads, HEAD_DIM=dim, BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n)
    return out


def mla_supports(rank: int, rope: int) -> bool:
    """Latent sizes the MLA kernel takes (padded to Triton tiles; every DeepSeek-V2/V3 size is)."""
    return rank >= 16 and rope >= 1 and rank + rope <= 1024


def mla_reference(q: torch.Tensor, cache: torch.Tensor, key_slots: torch.Tensor, lengths: torch.Tensor, rank: int,
                  scale: float) -> torch.Tensor:
    """q [S, H, rank + rope], cache [slots, rank + rope] → [S, H, rank] in float32."""
    s, heads, _ = q.shape
    out = torch.empty(s, heads, rank, dtype=torch.float32, device=q.device)
    for i in range(s):
        entries = cache[key_slots[i, :int(lengths[i])].long()].float()  # [L, rank + rope]
        weights = torch.softmax(q[i].float() @ entries.T * scale, dim=-1)
        out[i] = weights @ entries[:, :rank]
    return out


def mla_decode_attention(q: torch.Tensor, cache: torch.Tensor, key_slots: torch.Tensor, lengths: torch.Tensor,
                         rank: int, scale: float, block_h: int = 16) -> torch.Tensor:
    """[S, H, rank] in q's dtype, through the Triton kernel."""
    import triton

    from quantship.kernels._paged_attention_triton import paged_mla_decode_kernel

    s, heads, width = q.shape
    rope = width - rank
    q = q.contiguous()
    out = torch.empty(s, heads, rank, dtype=q.dtype, device=q.device)
    block_r = max(16, triton.next_power_of_2(rank))
    # Keep a tile of latent entries (BLOCK_N x rank) within what the pipeline stages can hold in shared memory.
    block_n = 32 if block_r >= 512 else 64
    paged_mla_decode_kernel[(s, triton.cdiv(heads, block_h))](
        q, cache, key_slots, lengths, out, key_slots.stride(0), cache.shape[1], heads, scale,
        RANK=rank, ROPE=rope, BLOCK_R=block_r, BLOCK_P=max(16, triton.next_power_of_2(rope)), BLOCK_H=block_h,
        BLOCK_N=block_n)
    return out
