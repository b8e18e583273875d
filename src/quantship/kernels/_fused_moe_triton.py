"""The Triton kernels behind kernels.fused_moe (imported only when launched; the layout is there)."""

import triton
import triton.language as tl

from quantship.kernels._pdl_triton import start_dependent
from quantship.kernels._wna16_triton import (
    _last_split,
    _take_sums,
    _tile_meta,
    _tile_offset,
    _tile_values_2d,
    _words,
    gemv_acc,
    gemv_product,
    gemv_tile,
    gemv_x,
    packed_tile_dot,
)


@triton.jit
def _dense_tile(w_ptr, expert, offs_k, offs_n, K, N, KN: tl.constexpr):
    """[BK, BN] float32 tile of one dense expert's weight, inputs by outputs: the checkpoint's [E, N, K]
    transposed, or (KN) packed experts dequantized once into [E, K, N]."""
    mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
    if KN:
        offsets = offs_k[:, None] * N + offs_n[None, :]
    else:
        offsets = offs_n[None, :] * K + offs_k[:, None]
    return tl.load(w_ptr + expert * N * K + offsets, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _packed_tile(w_ptr, s_ptr, z_ptr, k0, offs_k, offs_n, K, N, group_size, BITS: tl.constexpr,
                 HAS_ZERO: tl.constexpr, SPANS: tl.constexpr):
    """[BK, BN] float32 tile of one packed expert, dequantized whole. SPANS: the tile straddles groups
    and scales are gathered per input row; else the group's scale row is loaded once."""
    q = _tile_values_2d(w_ptr, offs_k, offs_n, tl.cdiv(K, 32 // BITS), N, BITS)
    if SPANS:
        ok = (offs_k[:, None] < K) & (offs_n[None, :] < N)
        meta = (offs_k // group_size)[:, None] * N + offs_n[None, :]
        offset = tl.zeros_like(q) + (1 << (BITS - 1))
        if HAS_ZERO:
            offset += tl.load(z_ptr + meta, mask=ok, other=0).to(tl.float32)
        tile = (q - offset) * tl.load(s_ptr + meta, mask=ok, other=0.0).to(tl.float32)
    else:
        offset = _tile_offset(z_ptr, k0 // group_size, offs_n, N, HAS_ZERO, BITS)
        scale = tl.load(s_ptr + (k0 // group_size) * N + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        tile = (q - offset[None, :]) * scale[None, :]
    return tile


@triton.jit
def _block_x(a_rows, a_ok, k0, K, BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """x's K tile of a block's rows (`a_rows`: a pointer to each row's start, `a_ok` its mask) as the block's
    product takes it (_block_step): packed experts in decode blocks [BM, R, P] (input k0 + r*P + i of each
    row, sliced per value position there), else [BM, BK]."""
    if BITS != 0 and BLOCK_M <= 16:
        PER_WORD: tl.constexpr = 32 // BITS
        r = tl.arange(0, BLOCK_K // PER_WORD)
        i = tl.arange(0, PER_WORD)
        k = k0 + r[None, :, None] * PER_WORD + i[None, None, :]
        x = tl.load(a_rows[:, None, None] + k, mask=a_ok[:, None, None] & (k < K), other=0.0)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(a_rows[:, None] + offs_k[None, :], mask=a_ok[:, None] & (offs_k[None, :] < K), other=0.0)
    return x


@triton.jit
def _block_step(acc, x, w_ptr, s_ptr, z_ptr, expert, k0, offs_n, K, N, group_size, BITS: tl.constexpr,
                HAS_ZERO: tl.constexpr, SPANS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                KN: tl.constexpr):
    """acc plus one K tile of one expert's product with x's tile (_block_x). BITS 0: dense [E, N, K] (KN:
    [E, K, N]). BITS 4/8: packed [E, ceil(K/P), N] int32 with scales [E, G, N] (and int8 zero points): decode
    blocks through the plain W4A16/W8A16 kernels' tile products (packed_tile_dot; the dense swap tile's
    product, the weight as the left operand, measured 1.3-1.7x slower here on an H100 and went), prefill
    blocks through whole dequantized tiles (measured faster for 64 rows). Static branches: the packed
    arithmetic is not even compiled for dense experts."""
    if BITS == 0:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        acc += tl.dot(x, _dense_tile(w_ptr, expert, offs_k, offs_n, K, N, KN).to(x.dtype), out_dtype=tl.float32)
    else:
        PER_WORD: tl.constexpr = 32 // BITS
        metas = tl.cdiv(K, group_size) * N
        w_ptr += expert * tl.cdiv(K, PER_WORD) * N
        s_ptr += expert * metas
        z_ptr += expert * metas
        if BLOCK_M <= 16:
            acc += packed_tile_dot(x, w_ptr, s_ptr, z_ptr, k0, offs_n, K, N, group_size, BITS, HAS_ZERO, SPANS)
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            tile = _packed_tile(w_ptr, s_ptr, z_ptr, k0, offs_k, offs_n, K, N, group_size, BITS, HAS_ZERO, SPANS)
            acc += tl.dot(x, tile.to(x.dtype), out_dtype=tl.float32)
    return acc


@triton.jit
def _expert_product(a_rows, a_ok, w_ptr, s_ptr, z_ptr, expert, offs_n, K, N, group_size, k_begin, k_end,
                    BITS: tl.constexpr, HAS_ZERO: tl.constexpr, SPANS: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KN: tl.constexpr):
    """[BLOCK_M, BN] float32: the rows of `a_rows` times one expert's weight, inputs k_begin .. k_end."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        x = _block_x(a_rows, a_ok, k0, K, BITS, BLOCK_M, BLOCK_K)
        acc = _block_step(acc, x, w_ptr, s_ptr, z_ptr, expert, k0, offs_n, K, N, group_size, BITS, HAS_ZERO, SPANS,
                          BLOCK_M, BLOCK_K, KN)
    return acc


@triton.jit
def _gate_up_products(a_rows, a_ok, gate_ptr, gate_s_ptr, gate_z_ptr, up_ptr, up_s_ptr, up_z_ptr, expert, offs_n,
                      K, N, group_size, k_begin, k_end, BITS: tl.constexpr, HAS_ZERO: tl.constexpr,
                      SPANS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      KN: tl.constexpr):
    """_expert_product for an expert's gate and up in one K loop: x's tile is loaded once for both."""
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        x = _block_x(a_rows, a_ok, k0, K, BITS, BLOCK_M, BLOCK_K)
        gate = _block_step(gate, x, gate_ptr, gate_s_ptr, gate_z_ptr, expert, k0, offs_n, K, N, group_size, BITS,
                           HAS_ZERO, SPANS, BLOCK_M, BLOCK_K, KN)
        up = _block_step(up, x, up_ptr, up_s_ptr, up_z_ptr, expert, k0, offs_n, K, N, group_size, BITS, HAS_ZERO,
                         SPANS, BLOCK_M, BLOCK_K, KN)
    return gate, up


@triton.jit
def _k_range(K, k_per_split):
    """This program's inputs: split program_id(2) of K."""
    k_begin = tl.program_id(2) * k_per_split
    return k_begin, tl.minimum(k_begin + k_per_split, K)


@triton.jit
def moe_gate_up_kernel(x_ptr, gate_ptr, gate_s_ptr, gate_z_ptr, up_ptr, up_s_ptr, up_z_ptr, act_ptr,
                       sorted_ids_ptr, block_expert_ptr, ws_ptr, counter_ptr, num_slots, expert_begin, num_experts, H,
                       I, TOP_K, group_size, k_per_split, BITS: tl.constexpr, HAS_ZERO: tl.constexpr,
                       SPANS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, KN: tl.constexpr, PDL: tl.constexpr):
    """act[slot, n] = silu(x[token] . gate[e, n]) * (x[token] . up[e, n]) for the block's slots. SPLIT: K
    is split over program_id(2); gate and up sums meet in the float32 workspace [2, slots, I] and the
    program adding a tile's last split applies SiLU and the product (wna16's in-kernel finish)."""
    start_dependent(PDL)
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    # Blocks past the last expert's run, or of experts outside expert_begin .. num_experts (a pass over a
    # chunk of dequantized experts), do nothing.
    if (expert >= expert_begin) & (expert < num_experts):
        e = (expert - expert_begin).to(tl.int64)  # offsets of large expert stacks pass 2^31
        slot = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = slot < num_slots
        token = tl.where(valid, slot // TOP_K, 0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        a_rows = x_ptr + token * H
        k_begin, k_end = _k_range(H, k_per_split)
        gate, up = _gate_up_products(a_rows, valid, gate_ptr, gate_s_ptr, gate_z_ptr, up_ptr, up_s_ptr, up_z_ptr, e,
                                     offs_n, H, I, group_size, k_begin, k_end, BITS, HAS_ZERO, SPANS, BLOCK_M, BLOCK_N,
                                     BLOCK_K, KN)
        mask = valid[:, None] & (offs_n[None, :] < I)
        offsets = slot[:, None] * I + offs_n[None, :]
        if SPLIT:
            tl.atomic_add(ws_ptr + offsets, gate, mask=mask, sem="relaxed")
            tl.atomic_add(ws_ptr + num_slots * I + offsets, up, mask=mask, sem="relaxed")
            if _last_split(counter_ptr + pid_m * tl.num_programs(1) + tl.program_id(1), tl.num_programs(2)):
                gate = _take_sums(ws_ptr + offsets, mask)
                up = _take_sums(ws_ptr + num_slots * I + offsets, mask)
                act = gate * tl.sigmoid(gate) * up
                tl.store(act_ptr + offsets, act.to(act_ptr.dtype.element_ty), mask=mask)
        else:
            act = gate * tl.sigmoid(gate) * up
            tl.store(act_ptr + offsets, act.to(act_ptr.dtype.element_ty), mask=mask)


@triton.jit
def moe_down_kernel(act_ptr, w_ptr, s_ptr, z_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, routing_ptr, ws_ptr,
                    counter_ptr, num_slots, expert_begin, num_experts, H, I, group_size, k_per_split,
                    BITS: tl.constexpr, HAS_ZERO: tl.constexpr, SPANS: tl.constexpr, SPLIT: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KN: tl.constexpr, PDL: tl.constexpr):
    """out[slot, n] = routing[slot] * (act[slot] . down[e, n]) for the block's slots (SPLIT: as gate/up,
    through the workspace [slots, H])."""
    start_dependent(PDL)
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if (expert >= expert_begin) & (expert < num_experts):
        e = (expert - expert_begin).to(tl.int64)  # offsets of large expert stacks pass 2^31
        slot = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = slot < num_slots
        row = tl.where(valid, slot, 0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        k_begin, k_end = _k_range(I, k_per_split)
        acc = _expert_product(act_ptr + row * I, valid, w_ptr, s_ptr, z_ptr, e, offs_n, I, H, group_size, k_begin,
                              k_end, BITS, HAS_ZERO, SPANS, BLOCK_M, BLOCK_N, BLOCK_K, KN)
        acc *= tl.load(routing_ptr + row, mask=valid, other=0.0)[:, None]
        mask = valid[:, None] & (offs_n[None, :] < H)
        offsets = slot[:, None] * H + offs_n[None, :]
        if SPLIT:
            tl.atomic_add(ws_ptr + offsets, acc, mask=mask, sem="relaxed")
            if _last_split(counter_ptr + pid_m * tl.num_programs(1) + tl.program_id(1), tl.num_programs(2)):
                tl.store(out_ptr + offsets, _take_sums(ws_ptr + offsets, mask).to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _expert_weight(w_ptr, s_ptr, z_ptr, e, K, N, group_size, BITS: tl.constexpr):
    """Packed expert e's weight, scales and zero points in stacks [E, ceil(K/P), N], [E, G, N]."""
    word_rows = tl.cdiv(K, 32 // BITS)
    metas = tl.cdiv(K, group_size) * N
    return w_ptr + e * word_rows * N, s_ptr + e * metas, z_ptr + e * metas


@triton.jit
def _row_sums(acc, SPANS: tl.constexpr):
    """A GEMV accumulator as [BN] sums (SPANS keeps one row per word row)."""
    if SPANS:
        out = tl.sum(acc, axis=0)
    else:
        out = acc
    return out


@triton.jit
def _slot_gemv(x_row, w_ptr, s_ptr, z_ptr, e, offs_n, K, N, group_size, k_begin, k_end, BITS: tl.constexpr,
               HAS_ZERO: tl.constexpr, SPANS: tl.constexpr, BF16X2: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """[BN] float32: one row of x times packed expert e's weight [E, ceil(K/P), N], inputs k_begin .. k_end,
    through the dense GEMV's tile (wna16 gemv_tile; BF16X2: int4 and bf16 x on a GPU, two values per
    instruction)."""
    ROWS: tl.constexpr = BLOCK_K // (32 // BITS)
    w_ptr, s_ptr, z_ptr = _expert_weight(w_ptr, s_ptr, z_ptr, e, K, N, group_size, BITS)
    r = tl.arange(0, ROWS)
    acc = gemv_acc(ROWS, BLOCK_N, SPANS)
    for k0 in range(k_begin, k_end, BLOCK_K):
        acc = gemv_tile(acc, x_row, w_ptr, s_ptr, z_ptr, k0, offs_n, r, tl.cdiv(K, 32 // BITS), N, K, N, 1,
                        group_size, BITS, HAS_ZERO, SPANS, BF16X2, False)
    return _row_sums(acc, SPANS)


@triton.jit
def _slot_gemv_gate_up(x_row, gate_ptr, gate_s_ptr, gate_z_ptr, up_ptr, up_s_ptr, up_z_ptr, e, offs_n, K, N,
                       group_size, k_begin, k_end, BITS: tl.constexpr, HAS_ZERO: tl.constexpr, SPANS: tl.constexpr,
                       BF16X2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """_slot_gemv for an expert's gate and up at once: both word tiles are loaded before x's tile, which
    both products share (one load and spread of x, both weights' loads in flight together)."""
    ROWS: tl.constexpr = BLOCK_K // (32 // BITS)
    word_rows = tl.cdiv(K, 32 // BITS)
    gate_ptr, gate_s_ptr, gate_z_ptr = _expert_weight(gate_ptr, gate_s_ptr, gate_z_ptr, e, K, N, group_size, BITS)
    up_ptr, up_s_ptr, up_z_ptr = _expert_weight(up_ptr, up_s_ptr, up_z_ptr, e, K, N, group_size, BITS)
    r = tl.arange(0, ROWS)
    gate = gemv_acc(ROWS, BLOCK_N, SPANS)
    up = gemv_acc(ROWS, BLOCK_N, SPANS)
    for k0 in range(k_begin, k_end, BLOCK_K):
        rows = k0 // (32 // BITS) + r
        # both weights' words first, then their scales, then x: the loads do not wait on each other
        gate_w, gate_hi = _words(gate_ptr, rows, offs_n, word_rows, N, N, 1)
        up_w, up_hi = _words(up_ptr, rows, offs_n, word_rows, N, N, 1)
        gate_scale, gate_base = _tile_meta(gate_s_ptr, gate_z_ptr, rows, k0, offs_n, word_rows, N, group_size, BITS,
                                           HAS_ZERO, SPANS)
        up_scale, up_base = _tile_meta(up_s_ptr, up_z_ptr, rows, k0, offs_n, word_rows, N, group_size, BITS,
                                       HAS_ZERO, SPANS)
        xs = gemv_x(x_row, k0, r, K, BITS, BF16X2, False)
        gate = gemv_product(gate, (gate_w, gate_hi, gate_scale, gate_base), xs, BITS, HAS_ZERO, SPANS, BF16X2)
        up = gemv_product(up, (up_w, up_hi, up_scale, up_base), xs, BITS, HAS_ZERO, SPANS, BF16X2)
    return _row_sums(gate, SPANS), _row_sums(up, SPANS)


@triton.jit
def moe_gemv_gate_up_kernel(x_ptr, gate_ptr, gate_s_ptr, gate_z_ptr, up_ptr, up_s_ptr, up_z_ptr, act_ptr, indices_ptr,
                            ws_ptr, counter_ptr, num_slots, H, I, TOP_K, group_size, k_per_split, BITS: tl.constexpr,
                            HAS_ZERO: tl.constexpr, SPANS: tl.constexpr, SPLIT: tl.constexpr, BF16X2: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """act[slot] = silu(x[token] . gate[e]) * (x[token] . up[e]) for packed experts, a program per (slot, BN
    outputs, K split): each slot is a GEMV row of its own expert, read straight from the routing (no
    alignment, no 16-row padding). For decode steps whose slots mostly pick different experts, where a
    16-row tensor-core block holds one real row and a program streams its expert's whole K alone.
    SPLIT: gate and up sums meet in the float32 workspace [2, slots, I]; the last split applies SiLU."""
    start_dependent(PDL)
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(indices_ptr + slot).to(tl.int64)  # offsets of large expert stacks pass 2^31
    x_row = x_ptr + (slot // TOP_K) * H
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_begin, k_end = _k_range(H, k_per_split)
    gate, up = _slot_gemv_gate_up(x_row, gate_ptr, gate_s_ptr, gate_z_ptr, up_ptr, up_s_ptr, up_z_ptr, e, offs_n, H,
                                  I, group_size, k_begin, k_end, BITS, HAS_ZERO, SPANS, BF16X2, BLOCK_N, BLOCK_K)
    mask = offs_n < I
    offsets = slot * I + offs_n
    if SPLIT:
        tl.atomic_add(ws_ptr + offsets, gate, mask=mask, sem="relaxed")
        tl.atomic_add(ws_ptr + num_slots * I + offsets, up, mask=mask, sem="relaxed")
        if _last_split(counter_ptr + slot * tl.num_programs(1) + pid_n, tl.num_programs(2)):
            gate = _take_sums(ws_ptr + offsets, mask)
            up = _take_sums(ws_ptr + num_slots * I + offsets, mask)
            tl.store(act_ptr + offsets, (gate * tl.sigmoid(gate) * up).to(act_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(act_ptr + offsets, (gate * tl.sigmoid(gate) * up).to(act_ptr.dtype.element_ty), mask=mask)


@triton.jit
def moe_gemv_down_kernel(act_ptr, w_ptr, s_ptr, z_ptr, out_ptr, indices_ptr, routing_ptr, ws_ptr, counter_ptr, H, I,
                         TOP_K, group_size, k_per_split, BITS: tl.constexpr, HAS_ZERO: tl.constexpr,
                         SPANS: tl.constexpr, SPLIT: tl.constexpr, BF16X2: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """out[token] = the sum over the token's slots of routing[slot] * (act[slot] . down[e]), written in
    out's dtype here (no reduction and cast after). SPLIT: a program per (slot, BN outputs, K split), each
    adding into the float32 workspace [tokens, H]; the program adding a token tile's last part (TOP_K slots
    x splits) writes it. Else (no workspace to be had) a program per (token, BN outputs) loops over the
    token's slots."""
    start_dependent(PDL)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs_n < H
    k_begin, k_end = _k_range(I, k_per_split)
    if SPLIT:
        slot = tl.program_id(0)
        token = slot // TOP_K
        e = tl.load(indices_ptr + slot).to(tl.int64)
        acc = tl.load(routing_ptr + slot) * _slot_gemv(act_ptr + slot * I, w_ptr, s_ptr, z_ptr, e, offs_n, I, H,
                                                       group_size, k_begin, k_end, BITS, HAS_ZERO, SPANS, BF16X2,
                                                       BLOCK_N, BLOCK_K)
        offsets = token * H + offs_n
        tl.atomic_add(ws_ptr + offsets, acc, mask=mask, sem="relaxed")
        if _last_split(counter_ptr + token * tl.num_programs(1) + pid_n, TOP_K * tl.num_programs(2)):
            tl.store(out_ptr + offsets, _take_sums(ws_ptr + offsets, mask).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        token = tl.program_id(0)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for j in range(TOP_K):
            slot = token * TOP_K + j
            e = tl.load(indices_ptr + slot).to(tl.int64)
            acc += tl.load(routing_ptr + slot) * _slot_gemv(act_ptr + slot * I, w_ptr, s_ptr, z_ptr, e, offs_n, I, H,
                                                            group_size, k_begin, k_end, BITS, HAS_ZERO, SPANS,
                                                            BF16X2, BLOCK_N, BLOCK_K)
        tl.store(out_ptr + token * H + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def align_kernel(indices_ptr, sorted_ids_ptr, block_expert_ptr, num_slots, num_experts, capacity,
                 BLOCK_M: tl.constexpr, EXPERTS: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """fused_moe.align_by_expert in one program (one launch where the torch ops take about twenty):
    count slots per expert, pad each expert's run to BLOCK_M, fill sorted_ids with the sentinel, name
    each block's expert, then place every slot at its expert's start plus its rank among the earlier
    slots of that expert (so the order is align_by_expert's stable sort). Slots go in chunks of CHUNK
    against all EXPERTS (a power of two >= num_experts) as a one-hot matrix."""
    start_dependent(PDL)
    experts = tl.arange(0, EXPERTS)
    counts = tl.zeros((EXPERTS,), dtype=tl.int32)
    for start in range(0, num_slots, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        chosen = tl.load(indices_ptr + offs, mask=offs < num_slots, other=EXPERTS).to(tl.int32)
        counts += tl.sum((chosen[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    real_end = tl.where(experts < num_experts, ends, capacity + 1)  # padding experts end past every block
    for start in range(0, capacity, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        tl.store(sorted_ids_ptr + offs, tl.zeros_like(offs) + num_slots, mask=offs < capacity)
    for first in range(0, capacity // BLOCK_M, CHUNK):
        block = first + tl.arange(0, CHUNK)
        # torch.searchsorted(ends, block * BLOCK_M, right=True): the experts whose run ends by the block's start
        expert = tl.sum((real_end[None, :] <= (block * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + block, expert, mask=block < capacity // BLOCK_M)
    tl.debug_barrier()  # the sentinel is written everywhere before slots overwrite their places
    seen = tl.zeros((EXPERTS,), dtype=tl.int32)
    for start in range(0, num_slots, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        chosen = tl.load(indices_ptr + offs, mask=offs < num_slots, other=EXPERTS).to(tl.int32)
        onehot = (chosen[:, None] == experts[None, :]).to(tl.int32)
        before = tl.cumsum(onehot, axis=0) - onehot + seen[None, :]  # earlier slots of each expert
        place = tl.sum((starts[None, :] + before) * onehot, axis=1)
        tl.store(sorted_ids_ptr + place, offs, mask=offs < num_slots)
        seen += tl.sum(onehot, axis=0)
