"""The Triton kernel behind kernels.paged_attention (imported only when launched; the layout is there)."""

import triton
import triton.language as tl


@triton.jit
def _online_softmax_step(scores, values, running_max, running_sum, acc):
    """Fold one block of keys into the running softmax: scores [BLOCK_H, BLOCK_N] (masked keys at -inf),
    values [BLOCK_N, D]; returns the new running max, sum and unnormalised output [BLOCK_H, D]."""
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    weights = tl.exp(scores - new_max[:, None])
    correction = tl.exp(running_max - new_max)
    running_sum = running_sum * correction + tl.sum(weights, axis=1)
    acc = acc * correction[:, None] + tl.dot(weights.to(values.dtype), values, out_dtype=tl.float32)
    return new_max, running_sum, acc


@triton.jit
def paged_decode_kernel(q_ptr, cache_ptr, slots_ptr, lengths_ptr, out_ptr, stride_slots, width, scale,
                        GROUP: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    heads = tl.arange(0, BLOCK_H)  # the query heads sharing this K/V head, padded to a dot tile
    h_ok = heads < GROUP
    d = tl.arange(0, HEAD_DIM)
    q_rows = (seq * KV_HEADS * GROUP + kv_head * GROUP + heads).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * HEAD_DIM + d[None, :], mask=h_ok[:, None], other=0.0)
    length = tl.load(lengths_ptr + seq)
    running_max = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, HEAD_DIM), dtype=tl.float32)
    for j0 in range(0, length, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        j_ok = j < length
        slot = tl.load(slots_ptr + seq * stride_slots + j, mask=j_ok, other=0).to(tl.int64)
        row = cache_ptr + slot[:, None] * width + d[None, :]
        k = tl.load(row + kv_head * HEAD_DIM, mask=j_ok[:, None], other=0.0)
        v = tl.load(row + (KV_HEADS + kv_head) * HEAD_DIM, mask=j_ok[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), out_dtype=tl.float32) * scale
        scores = tl.where(j_ok[None, :], scores, float("-inf"))
        running_max, running_sum, acc = _online_softmax_step(scores, v, running_max, running_sum, acc)
    out = acc / running_sum[:, None]
    tl.store(out_ptr + q_rows[:, None] * HEAD_DIM + d[None, :], out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])


@triton.jit
def paged_mla_decode_kernel(q_ptr, cache_ptr, slots_ptr, lengths_ptr, out_ptr, stride_slots, width, heads, scale,
                            RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                            BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    """One sequence, BLOCK_H of its heads: every head attends to the same latent entries (c_kv ‖ k_rope)."""
    seq = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < heads
    r = tl.arange(0, BLOCK_R)
    r_ok = r < RANK
    p = tl.arange(0, BLOCK_P)
    p_ok = p < ROPE
    q_rows = (seq * heads + h).to(tl.int64)
    q_row = q_ptr + q_rows[:, None] * (RANK + ROPE)
    q_latent = tl.load(q_row + r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    q_rope = tl.load(q_row + RANK + p[None, :], mask=h_ok[:, None] & p_ok[None, :], other=0.0)
    length = tl.load(lengths_ptr + seq)
    running_max = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_R), dtype=tl.float32)
    for j0 in range(0, length, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        j_ok = j < length
        slot = tl.load(slots_ptr + seq * stride_slots + j, mask=j_ok, other=0).to(tl.int64)
        entry = cache_ptr + slot[:, None] * width
        latent = tl.load(entry + r[None, :], mask=j_ok[:, None] & r_ok[None, :], other=0.0)
        k_rope = tl.load(entry + RANK + p[None, :], mask=j_ok[:, None] & p_ok[None, :], other=0.0)
        scores = tl.dot(q_latent, tl.trans(latent), out_dtype=tl.float32)
        scores += tl.dot(q_rope, tl.trans(k_rope), out_dtype=tl.float32)
        scores = tl.where(j_ok[None, :], scores * scale, float("-inf"))
        running_max, running_sum, acc = _online_softmax_step(scores, latent, running_max, running_sum, acc)
    out = acc / running_sum[:, None]
    tl.store(out_ptr + q_rows[:, None] * RANK + r[None, :], out.to(out_ptr.dtype.element_ty),
             mask=h_ok[:, None] & r_ok[None, :])
