"""The Triton kernels behind kernels.fused_moe (imported only when launched; the layout is there)."""

import triton
import triton.language as tl

from quantship.kernels._wna16_triton import _to_float


@triton.jit
def _expert_tile(w_ptr, s_ptr, z_ptr, expert, offs_k, offs_n, k0, K, N, group_size,
                 BITS: tl.constexpr, HAS_ZERO: tl.constexpr):
    """[BK, BN] float32 tile of one expert's weight, transposed (input rows by output columns).

    BITS 0: dense [E, N, K]. BITS 4/8: packed [E, ceil(K/P), N] int32 with scales [E, G, N] (and int8
    zero points), the tile inside one group, dequantized in registers."""
    k_ok = offs_k < K
    n_ok = offs_n < N
    mask = k_ok[:, None] & n_ok[None, :]
    if BITS == 0:  # a static branch: the packed arithmetic below is not even compiled for dense experts
        tile = tl.load(w_ptr + expert * N * K + offs_n[None, :] * K + offs_k[:, None], mask=mask,
                       other=0.0).to(tl.float32)
    else:
        rows = tl.cdiv(K, 32 // BITS)
        words = tl.load(w_ptr + expert * rows * N + (offs_k[:, None] // (32 // BITS)) * N + offs_n[None, :],
                        mask=mask, other=0)
        q = _to_float((words >> ((offs_k[:, None] % (32 // BITS)) * BITS)) & ((1 << BITS) - 1))
        groups = tl.cdiv(K, group_size)
        group = k0 // group_size
        scale = tl.load(s_ptr + (expert * groups + group) * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        offset = tl.zeros_like(scale) + (1 << (BITS - 1))
        if HAS_ZERO:
            offset += tl.load(z_ptr + (expert * groups + group) * N + offs_n, mask=n_ok, other=0).to(tl.float32)
        tile = (q - offset[None, :]) * scale[None, :]
    return tile


@triton.jit
def moe_gate_up_kernel(x_ptr, gate_ptr, gate_s_ptr, gate_z_ptr, up_ptr, up_s_ptr, up_z_ptr, act_ptr,
                       sorted_ids_ptr, block_expert_ptr, num_slots, num_experts, H, I, TOP_K, group_size,
                       BITS: tl.constexpr, HAS_ZERO: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """act[slot, n] = silu(x[token] . gate[e, n]) * (x[token] . up[e, n]) for the block's slots."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < num_experts:  # blocks past the last expert's run do nothing
        e = expert.to(tl.int64)  # offsets of large expert stacks pass 2^31
        slot = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = slot < num_slots
        token = tl.where(valid, slot // TOP_K, 0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + token[:, None] * H + offs_k[None, :], mask=valid[:, None] & (offs_k[None, :] < H),
                        other=0.0)
            w_gate = _expert_tile(gate_ptr, gate_s_ptr, gate_z_ptr, e, offs_k, offs_n, k0, H, I, group_size,
                                  BITS, HAS_ZERO)
            w_up = _expert_tile(up_ptr, up_s_ptr, up_z_ptr, e, offs_k, offs_n, k0, H, I, group_size,
                                BITS, HAS_ZERO)
            gate += tl.dot(a, w_gate.to(a.dtype), out_dtype=tl.float32)
            up += tl.dot(a, w_up.to(a.dtype), out_dtype=tl.float32)
        act = gate * tl.sigmoid(gate) * up
        tl.store(act_ptr + slot[:, None] * I + offs_n[None, :], act.to(act_ptr.dtype.element_ty),
                 mask=valid[:, None] & (offs_n[None, :] < I))


@triton.jit
def moe_down_kernel(act_ptr, w_ptr, s_ptr, z_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, routing_ptr, num_slots,
                    num_experts, H, I, group_size, BITS: tl.constexpr, HAS_ZERO: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[slot, n] = routing[slot] * (act[slot] . down[e, n]) for the block's slots."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < num_experts:
        e = expert.to(tl.int64)  # offsets of large expert stacks pass 2^31
        slot = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = slot < num_slots
        row = tl.where(valid, slot, 0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(act_ptr + row[:, None] * I + offs_k[None, :], mask=valid[:, None] & (offs_k[None, :] < I),
                        other=0.0)
            w = _expert_tile(w_ptr, s_ptr, z_ptr, e, offs_k, offs_n, k0, I, H, group_size, BITS, HAS_ZERO)
            acc += tl.dot(a, w.to(a.dtype), out_dtype=tl.float32)
        acc *= tl.load(routing_ptr + row, mask=valid, other=0.0)[:, None]
        tl.store(out_ptr + slot[:, None] * H + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=valid[:, None] & (offs_n[None, :] < H))
