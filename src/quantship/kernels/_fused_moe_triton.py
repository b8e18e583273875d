"""The Triton kernels behind kernels.fused_moe (imported only when launched; the layout is there)."""

import triton
import triton.language as tl


@triton.jit
def moe_gate_up_kernel(x_ptr, w_ptr, act_ptr, sorted_ids_ptr, block_expert_ptr, num_slots, num_experts, H, I,
                       TOP_K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """act[slot, n] = silu(x[token] . gate[e, n]) * (x[token] . up[e, n]) for the block's slots."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < num_experts:  # blocks past the last expert's run do nothing
        slot = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = slot < num_slots
        token = tl.where(valid, slot // TOP_K, 0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < I
        w_expert = w_ptr + expert.to(tl.int64) * 2 * I * H
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < H
            a = tl.load(x_ptr + token[:, None] * H + offs_k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & n_ok[None, :]
            w_gate = tl.load(w_expert + offs_n[None, :] * H + offs_k[:, None], mask=w_mask, other=0.0)
            w_up = tl.load(w_expert + (I + offs_n[None, :]) * H + offs_k[:, None], mask=w_mask, other=0.0)
            gate += tl.dot(a, w_gate, out_dtype=tl.float32)
            up += tl.dot(a, w_up, out_dtype=tl.float32)
        act = gate * tl.sigmoid(gate) * up
        tl.store(act_ptr + slot[:, None] * I + offs_n[None, :], act.to(act_ptr.dtype.element_ty),
                 mask=valid[:, None] & n_ok[None, :])


@triton.jit
def moe_down_kernel(act_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, routing_ptr, num_slots, num_experts,
                    H, I, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[slot, n] = routing[slot] * (act[slot] . down[e, n]) for the block's slots."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < num_experts:
        slot = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = slot < num_slots
        row = tl.where(valid, slot, 0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < H
        w_expert = w_ptr + expert.to(tl.int64) * H * I
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < I
            a = tl.load(act_ptr + row[:, None] * I + offs_k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_expert + offs_n[None, :] * I + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :],
                        other=0.0)
            acc += tl.dot(a, w, out_dtype=tl.float32)
        acc *= tl.load(routing_ptr + row, mask=valid, other=0.0)[:, None]
        tl.store(out_ptr + slot[:, None] * H + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=valid[:, None] & n_ok[None, :])
