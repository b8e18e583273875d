"""Fused mixture-of-experts: every routed expert of a layer in two Triton launches, no host sync.

The host loop over experts (count tokens per expert, `.tolist()`, one small matmul each) reads the
routing on the host every layer, which stops decode steps from being captured as CUDA graphs. Here:

1. `align_by_expert`: the (token, choice) slots are sorted by expert on the device and each expert's
   run is padded to a multiple of BLOCK_M, inside a buffer of static size (slots + E * (BLOCK_M - 1));
   `block_expert[b]` names the expert of block b, or E for blocks past the end (they do nothing).
2. `gate_up`: per block, the rows' tokens times the expert's gate and up weights, SiLU(gate) * up
   fused in the epilogue → act [slots, I].
3. `down`: act times the expert's down weight, scaled by the slot's routing weight → [slots, H];
   the k slots of a token are summed by one torch op.

Weights are stacked per layer: gate_up [E, 2I, H] (gate rows, then up rows) and down [E, H, I], the
checkpoint's per-expert [out, in] matrices. `reference` is the plain loop the kernels must equal.
The shapes are those of vLLM's fused_moe (its sorted-token layout is the anchor); the code is ours.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
              indices: torch.Tensor) -> torch.Tensor:
    """x [N, H], gate_up [E, 2I, H], down [E, H, I], routing weights/indices [N, k] → [N, H] (float32)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter = down.shape[2]
    for e in range(gate_up.shape[0]):
        token, slot = torch.where(indices == e)
        if token.numel() == 0:
            continue
        h = F.linear(x[token].float(), gate_up[e].float())
        act = F.silu(h[:, :inter]) * h[:, inter:]
        out.index_add_(0, token, F.linear(act, down[e].float()) * weights[token, slot, None].float())
    return out


def block_m_for(slots: int, num_experts: int) -> int:
    """Rows per block: 16 when experts see a few tokens each (decode), 64 when they see many (prefill)."""
    return 64 if slots >= 64 * num_experts else 16


def align_by_expert(indices: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots sorted by expert, each expert's run padded to block_m: (sorted_ids [C], block_expert [C / block_m]).

    Padding entries hold the number of slots (a sentinel). All tensor ops: nothing is read on the host.
    """
    flat = indices.flatten()
    slots = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync to size its output
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = flat.argsort(stable=True)
    expert = flat[order]
    rank = torch.arange(slots, device=flat.device) - (counts.cumsum(0) - counts)[expert]
    capacity = -(-(slots + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.full((capacity,), slots, dtype=torch.int32, device=flat.device)
    sorted_ids[(ends - padded)[expert] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, capacity, block_m, device=flat.device)
    block_expert = torch.searchsorted(ends, block_start, right=True).to(torch.int32)
    return sorted_ids, block_expert


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
              indices: torch.Tensor, block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    """The routed experts' output [N, H] in x's dtype, through the two Triton kernels."""
    import triton

    from quantship.kernels._fused_moe_triton import moe_down_kernel, moe_gate_up_kernel

    n, hidden = x.shape
    num_experts, inter, top_k = gate_up.shape[0], down.shape[2], indices.shape[1]
    slots = n * top_k
    block_m = block_m_for(slots, num_experts)
    sorted_ids, block_expert = align_by_expert(indices, num_experts, block_m)
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    act = torch.empty(slots, inter, dtype=x.dtype, device=x.device)
    blocks = block_expert.numel()
    common = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    moe_gate_up_kernel[(blocks, triton.cdiv(inter, block_n))](
        x, gate_up, act, sorted_ids, block_expert, slots, num_experts, hidden, inter, top_k, **common)
    out = torch.empty(slots, hidden, dtype=x.dtype, device=x.device)
    moe_down_kernel[(blocks, triton.cdiv(hidden, block_n))](
        act, down, out, sorted_ids, block_expert, weights.reshape(-1).float().contiguous(), slots, num_experts,
        hidden, inter, **common)
    return out.view(n, top_k, hidden).sum(1)
