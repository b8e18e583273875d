"""The Triton kernels behind kernels.paged_attention (imported only when launched; the layout is there).

Both decode kernels take a third grid axis of key splits (flash-decoding): split i walks keys
i * keys_per_split .. (i + 1) * keys_per_split - 1 of its sequence and, where there is more than one
split (SPLIT), stores its unnormalised output and its running max and sum for combine_splits_kernel;
with one split the program normalises and stores the output itself.
"""

import triton
import triton.language as tl

from quantship.kernels._pdl_triton import start_dependent


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
def _finish(acc, running_max, running_sum, out_ptr, part_ptr, stats_ptr, rows, rows_ok, cols, cols_ok, D,
            SPLIT: tl.constexpr):
    """A program's output rows [BLOCK_H, D]: normalised into out [rows, D] (one split; a row with no keys
    comes out 0), or its split's unnormalised sums into part [rows, splits, D] and (max, sum) into
    stats [rows, splits, 2]."""
    mask = rows_ok[:, None] & cols_ok[None, :]
    if SPLIT:
        at = rows * tl.num_programs(2) + tl.program_id(2)
        tl.store(part_ptr + at[:, None] * D + cols[None, :], acc, mask=mask)
        tl.store(stats_ptr + at * 2, running_max, mask=rows_ok)
        tl.store(stats_ptr + at * 2 + 1, running_sum, mask=rows_ok)
    else:
        out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]  # no keys (a padding row): 0
        tl.store(out_ptr + rows[:, None] * D + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def combine_splits_kernel(part_ptr, stats_ptr, out_ptr, splits, D: tl.constexpr, BLOCK_S: tl.constexpr,
                          BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """One output row from its splits: each split's sums rescaled to the largest running max, added, and
    divided by the rescaled sum of the softmax denominators. Splits past a sequence's length hold a max
    of -inf and weigh nothing; a row with no keys at all (a graph's padding row) comes out 0."""
    start_dependent(PDL)
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < splits
    d = tl.arange(0, BLOCK_D)
    at = row * splits + s
    maxes = tl.load(stats_ptr + at * 2, mask=s_ok, other=float("-inf"))
    sums = tl.load(stats_ptr + at * 2 + 1, mask=s_ok, other=0.0)
    top = tl.max(maxes, axis=0)
    top = tl.where(top > float("-inf"), top, 0.0)  # no split saw a key: every weight is exp(-inf) = 0
    weight = tl.exp(maxes - top)
    total = tl.sum(weight * sums, axis=0)
    acc = tl.load(part_ptr + at[:, None] * D + d[None, :], mask=s_ok[:, None] & (d < D)[None, :], other=0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * D + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def _key_range(lengths_ptr, seq, keys_per_split):
    """[begin, end) of the keys this program's split walks (empty past the sequence's length)."""
    length = tl.load(lengths_ptr + seq)
    begin = tl.program_id(2) * keys_per_split
    return begin, tl.minimum(begin + keys_per_split, length)


@triton.jit
def paged_decode_kernel(q_ptr, cos_ptr, sin_ptr, cache_ptr, slots_ptr, lengths_ptr, out_ptr, part_ptr, stats_ptr,
                        stride_qs, stride_qh, stride_cos, stride_slots, width, scale, keys_per_split,
                        GROUP: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_HALF: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, ROTATE: tl.constexpr,
                        INTERLEAVED: tl.constexpr, PDL: tl.constexpr):
    """One sequence and one K/V head with the query heads sharing it. Keys and queries are multiplied in
    their two rotary halves (as the cache holds the keys); the queries come as projected (any row
    strides) and are rotated here where ROTATE (one launch instead of the rope kernel and this)."""
    start_dependent(PDL)
    HALF: tl.constexpr = HEAD_DIM // 2
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    heads = tl.arange(0, BLOCK_H)  # the query heads sharing this K/V head, padded to a dot tile
    h_ok = heads < GROUP
    head = kv_head * GROUP + heads
    d = tl.arange(0, HEAD_DIM)
    p = tl.arange(0, BLOCK_HALF)
    p_ok = p < HALF
    q_rows = seq * KV_HEADS * GROUP + head
    q_first, q_second = _query_rope(q_ptr + seq * stride_qs + head[:, None] * stride_qh, cos_ptr + seq * stride_cos,
                                    sin_ptr + seq * stride_cos, h_ok, p, p_ok, HALF, ROTATE, INTERLEAVED)
    begin, end = _key_range(lengths_ptr, seq, keys_per_split)
    running_max = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, HEAD_DIM), dtype=tl.float32)
    for j0 in range(begin, end, BLOCK_N):  # every block holds a key below `end`: the running max is finite
        j = j0 + tl.arange(0, BLOCK_N)
        j_ok = j < end
        slot = tl.load(slots_ptr + seq * stride_slots + j, mask=j_ok, other=0).to(tl.int64)
        row = cache_ptr + slot[:, None] * width
        key = row + kv_head * HEAD_DIM
        k_ok = j_ok[:, None] & p_ok[None, :]
        k_first = tl.load(key + p[None, :], mask=k_ok, other=0.0)
        k_second = tl.load(key + HALF + p[None, :], mask=k_ok, other=0.0)
        v = tl.load(row + (KV_HEADS + kv_head) * HEAD_DIM + d[None, :], mask=j_ok[:, None], other=0.0)
        scores = tl.dot(q_first, tl.trans(k_first), out_dtype=tl.float32)
        scores += tl.dot(q_second, tl.trans(k_second), out_dtype=tl.float32)
        scores = tl.where(j_ok[None, :], scores * scale, float("-inf"))
        running_max, running_sum, acc = _online_softmax_step(scores, v, running_max, running_sum, acc)
    _finish(acc, running_max, running_sum, out_ptr, part_ptr, stats_ptr, q_rows, h_ok, d, d < HEAD_DIM, HEAD_DIM, SPLIT)


@triton.jit
def _round(v, like):
    return v.to(like.dtype).to(tl.float32)


@triton.jit
def _query_rope(qr_row, cos_row, sin_row, rows_ok, p, p_ok, HALF: tl.constexpr, ROTATE: tl.constexpr,
                INTERLEAVED: tl.constexpr):
    """The two halves [BLOCK_H, BLOCK_HALF] of the queries' rope part, as the cache holds its keys' (halves
    layout): read as they are, or (ROTATE) rotated here from the projection's output, each product and sum
    rounded to the queries' dtype as the rope kernel rounds them (kernels/elementwise.py)."""
    mask = rows_ok[:, None] & p_ok[None, :]
    if ROTATE and INTERLEAVED:  # pairs (x0, x1), (x2, x3), ...
        a = tl.load(qr_row + 2 * p[None, :], mask=mask, other=0.0)
        b = tl.load(qr_row + 2 * p[None, :] + 1, mask=mask, other=0.0)
    else:
        a = tl.load(qr_row + p[None, :], mask=mask, other=0.0)
        b = tl.load(qr_row + HALF + p[None, :], mask=mask, other=0.0)
    if ROTATE:
        c = _round(tl.load(cos_row + p, mask=p_ok, other=0.0).to(tl.float32), a)[None, :]
        s = _round(tl.load(sin_row + p, mask=p_ok, other=0.0).to(tl.float32), a)[None, :]
        af, bf = a.to(tl.float32), b.to(tl.float32)
        first = _round(_round(af * c, a) - _round(bf * s, a), a).to(a.dtype)
        second = _round(_round(bf * c, a) + _round(af * s, a), a).to(a.dtype)
        return first, second
    return a, b


@triton.jit
def paged_mla_decode_kernel(q_ptr, qr_ptr, cos_ptr, sin_ptr, cache_ptr, slots_ptr, lengths_ptr, out_ptr, part_ptr,
                            stats_ptr, stride_qs, stride_qh, stride_rs, stride_rh, stride_cos, stride_slots, width,
                            heads, scale, keys_per_split, RANK: tl.constexpr, HALF: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                            BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, ROTATE: tl.constexpr,
                            INTERLEAVED: tl.constexpr, PDL: tl.constexpr):
    """One sequence, BLOCK_H of its heads: every head attends to the same latent entries (c_kv ‖ k_rope).
    The queries come in two parts (latent [S, H, RANK] and rope [S, H, 2 * HALF], any row strides), the
    rope part rotated here where ROTATE (one launch instead of the rope kernel, the concatenation and this)."""
    start_dependent(PDL)
    seq = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < heads
    r = tl.arange(0, BLOCK_R)
    r_ok = r < RANK
    p = tl.arange(0, BLOCK_HALF)
    p_ok = p < HALF
    q_rows = seq * heads + h
    q_latent = tl.load(q_ptr + seq * stride_qs + h[:, None] * stride_qh + r[None, :],
                       mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    q_first, q_second = _query_rope(qr_ptr + seq * stride_rs + h[:, None] * stride_rh, cos_ptr + seq * stride_cos,
                                    sin_ptr + seq * stride_cos, h_ok, p, p_ok, HALF, ROTATE, INTERLEAVED)
    begin, end = _key_range(lengths_ptr, seq, keys_per_split)
    running_max = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_R), dtype=tl.float32)
    for j0 in range(begin, end, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        j_ok = j < end
        slot = tl.load(slots_ptr + seq * stride_slots + j, mask=j_ok, other=0).to(tl.int64)
        entry = cache_ptr + slot[:, None] * width
        latent = tl.load(entry + r[None, :], mask=j_ok[:, None] & r_ok[None, :], other=0.0)
        rope_ok = j_ok[:, None] & p_ok[None, :]
        k_first = tl.load(entry + RANK + p[None, :], mask=rope_ok, other=0.0)
        k_second = tl.load(entry + RANK + HALF + p[None, :], mask=rope_ok, other=0.0)
        scores = tl.dot(q_latent, tl.trans(latent), out_dtype=tl.float32)
        scores += tl.dot(q_first, tl.trans(k_first), out_dtype=tl.float32)
        scores += tl.dot(q_second, tl.trans(k_second), out_dtype=tl.float32)
        scores = tl.where(j_ok[None, :], scores * scale, float("-inf"))
        running_max, running_sum, acc = _online_softmax_step(scores, latent, running_max, running_sum, acc)
    _finish(acc, running_max, running_sum, out_ptr, part_ptr, stats_ptr, q_rows, h_ok, r, r_ok, RANK, SPLIT)
