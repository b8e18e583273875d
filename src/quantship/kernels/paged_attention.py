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

Few sequences give few programs: V2-Lite's 16 heads at batch 1 are one program walking the whole
context on one SM. Both kernels therefore split the key axis too (enough parts to fill
the GPU: split_plan), each split keeping its own running softmax, and a second launch combines the splits of
each row (flash-decoding's reduction).
"""

from __future__ import annotations

import torch

from quantship.kernels import PLAIN_ROUNDING, dependent_launch, sm_count


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


def _unit_rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def decode_attention(q: torch.Tensor, cache: torch.Tensor, key_slots: torch.Tensor, lengths: torch.Tensor,
                     kv_heads: int, scale: float, block_n: int | None = None, splits: int | None = None,
                     rope: tuple[torch.Tensor, torch.Tensor, bool] | None = None,
                     num_warps: int | None = None) -> torch.Tensor:
    """[S, H, D] in q's dtype, through the Triton kernel; `splits` of the key axis (default: split_plan's).
    q rotated already (halves layout, as the cache holds the keys), or as projected with `rope` = (cos, sin
    [S, D / 2], interleaved): the kernel rotates it (elementwise.rope's rounding). Any row strides.
    `block_n` keys per block and `num_warps`: default decode_tiles'."""
    import triton

    from quantship.kernels._paged_attention_triton import paged_decode_kernel

    s, heads, dim = q.shape
    group = heads // kv_heads
    default_block_n, default_warps = decode_tiles(s * kv_heads, sm_count(q.device))
    block_n, num_warps = block_n or default_block_n, num_warps or default_warps
    q = _unit_rows(q)
    cos, sin, interleaved = (q, q, False) if rope is None else (rope[0].contiguous(), rope[1].contiguous(), rope[2])
    out = torch.empty(s, heads, dim, dtype=q.dtype, device=q.device)
    splits, keys_per_split = split_plan(key_slots.shape[1], block_n, s * kv_heads, sm_count(q.device), splits)
    part, stats = _split_buffers(s * heads, splits, dim, q.device)
    paged_decode_kernel[(s, kv_heads, splits)](
        q, cos, sin, cache, key_slots, lengths, out, part, stats, q.stride(0), q.stride(1), cos.stride(0),
        key_slots.stride(0), cache.shape[1], scale, keys_per_split, GROUP=group, KV_HEADS=kv_heads, HEAD_DIM=dim,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_HALF=max(16, dim // 2), BLOCK_N=block_n,
        SPLIT=splits > 1, ROTATE=rope is not None, INTERLEAVED=interleaved, num_warps=num_warps,
        **(PLAIN_ROUNDING if rope is not None else {}), **dependent_launch(q))
    return _combine(part, stats, out, splits)


def decode_tiles(programs: int, sms: int) -> tuple[int, int]:
    """(keys per block, warps) of the multi-head kernel for `programs` sequences x K/V heads. Where they
    are no more than the SMs, each program has an SM to itself and walks its keys in blocks of 128 with 4
    warps: half the dependent steps (slot, then key and value loads, then the softmax) of 64-key blocks.
    Where they are more, blocks of 64 with 2 warps (more programs resident on each SM).
    benchmarks/kernel_paged_attention.py mha (6.7B heads, H200): batch 1 at 128 and 256 keys 3.9 and
    6.4 µs against 6.0 and 10.0 in blocks of 64; batches 16 and 64 2-4% faster with 2 warps than 4."""
    return (128, 4) if programs <= sms else (64, 2)


def mla_supports(rank: int, rope: int) -> bool:
    """Latent sizes the MLA kernel takes (padded to Triton tiles; every DeepSeek-V2/V3 size is)."""
    return rank >= 16 and rope >= 2 and rope % 2 == 0 and rank + rope <= 1024


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
                         rank: int, scale: float, block_h: int = 16, splits: int | None = None,
                         rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool] | None = None) -> torch.Tensor:
    """[S, H, rank] in q's dtype, through the Triton kernel; `splits` of the key axis (default: split_plan's).

    q is [S, H, rank + rope], its rope part rotated (halves layout, as the cache holds the keys'); or, with
    `rope` = (q_rope [S, H, rope] as projected, cos, sin [S, rope / 2], interleaved), q is the latent part
    [S, H, rank] alone and the kernel rotates q_rope itself (elementwise.rope's rounding). Any row strides."""
    import triton

    from quantship.kernels._paged_attention_triton import paged_mla_decode_kernel

    s, heads = q.shape[:2]
    if rope is None:
        q = _unit_rows(q)
        q_latent, q_rope, cos, sin, interleaved = q[..., :rank], q[..., rank:], q, q, False
    else:
        q_latent, (q_rope, cos, sin, interleaved) = _unit_rows(q), rope
        q_rope, cos, sin = _unit_rows(q_rope), cos.contiguous(), sin.contiguous()
    half = q_rope.shape[-1] // 2
    out = torch.empty(s, heads, rank, dtype=q.dtype, device=q.device)
    block_n = mla_block_n(rank)
    head_blocks = triton.cdiv(heads, block_h)
    splits, keys_per_split = split_plan(key_slots.shape[1], block_n, s * head_blocks, sm_count(q.device), splits)
    part, stats = _split_buffers(s * heads, splits, rank, q.device)
    paged_mla_decode_kernel[(s, head_blocks, splits)](
        q_latent, q_rope, cos, sin, cache, key_slots, lengths, out, part, stats, q_latent.stride(0),
        q_latent.stride(1), q_rope.stride(0), q_rope.stride(1), cos.stride(0), key_slots.stride(0), cache.shape[1],
        heads, scale, keys_per_split, RANK=rank, HALF=half, BLOCK_R=max(16, triton.next_power_of_2(rank)),
        BLOCK_HALF=max(16, triton.next_power_of_2(half)), BLOCK_H=block_h, BLOCK_N=block_n, SPLIT=splits > 1,
        ROTATE=rope is not None, INTERLEAVED=interleaved, **(PLAIN_ROUNDING if rope is not None else {}),
        **dependent_launch(q_latent))
    return _combine(part, stats, out, splits)


# Programs per SM a decode step's attention should give the GPU before its keys are split further.
PROGRAMS_PER_SM = 2
MAX_SPLITS = 16  # the combine holds every split of a row at once
# Key blocks a split must spare each program before it pays for the combine's launch and traffic
# (benchmarks/kernel_paged_attention.py, H200: a block is about 1.9 µs of MLA's loop, 1.4 of Llama's;
# the combine 2 µs at batch 1, more where many rows write their splits).
MIN_BLOCKS_SAVED = 3


def mla_block_n(rank: int) -> int:
    """Keys per block of the MLA kernel: a tile of latent entries (block x rank) must stay within what
    the pipeline stages can hold in shared memory."""
    return 32 if rank > 256 else 64


def split_plan(key_len: int, block_n: int, programs: int, sms: int, splits: int | None = None) -> tuple[int, int]:
    """(splits, keys per split, whole blocks of block_n) of the key axis (padded to key_len). Without
    `splits`: enough that `programs` (sequences x head blocks) times the splits fill PROGRAMS_PER_SM
    programs per SM. Unsplit, a batch-1 decode is one program per head block walking every key alone
    (V2-Lite's 16 heads: one program on one SM). key_len is a CUDA graph's fixed key bucket, so a
    graph's split never changes; splits past a sequence's length do nothing. A bucket holds contexts
    from half its length, so the split must spare MIN_BLOCKS_SAVED blocks per program there, or the key
    axis stays whole."""
    blocks = max(1, -(-key_len // block_n))
    if splits is None:
        wanted = -(-PROGRAMS_PER_SM * sms // max(programs, 1))
        splits = max(1, min(MAX_SPLITS, blocks, wanted))
        half = -(-blocks // 2)
        if half - min(-(-blocks // splits), half) < MIN_BLOCKS_SAVED:
            splits = 1
    per_split = -(-blocks // splits)
    return -(-blocks // per_split), per_split * block_n


def _split_buffers(rows: int, splits: int, dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each split's unnormalised output [rows, splits, dim] and (running max, sum) [rows, splits, 2], float32;
    one-element placeholders when the key axis is not split."""
    if splits == 1:
        empty = torch.empty(1, dtype=torch.float32, device=device)
        return empty, empty
    return (torch.empty(rows, splits, dim, dtype=torch.float32, device=device),
            torch.empty(rows, splits, 2, dtype=torch.float32, device=device))


def _combine(part: torch.Tensor, stats: torch.Tensor, out: torch.Tensor, splits: int) -> torch.Tensor:
    """out from the splits' partial results (a second launch), or as the kernel stored it (one split)."""
    if splits == 1:
        return out
    import triton

    from quantship.kernels._paged_attention_triton import combine_splits_kernel

    rows, _, dim = part.shape
    combine_splits_kernel[(rows,)](part, stats, out, splits, D=dim, BLOCK_S=triton.next_power_of_2(splits),
                                   BLOCK_D=triton.next_power_of_2(dim), **dependent_launch(out))
    return out
