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

Each projection of all experts is stacked once per layer (`ExpertWeights`): dense [E, out, in] as the
checkpoint's [out, in] matrices, or W4A16/W8A16 packed [E, in/P, out] int32 with scales [E, G, out]
(and zero points), the layout of kernels/wna16.py, dequantized in registers by the same tile
product (wna16 packed_tile_dot: each word loaded once; tiles may span groups). Packed experts take
two other routes where those blocks measured slow: a decode step whose slots mostly pick
different experts runs each slot as a GEMV row of its own expert (the dense GEMV's tile, int4 in
bf16x2 pairs on a GPU; down sums each token's slots in the kernel), so no program streams an
expert's whole K alone; a prefill step (64+ slots per expert) dequantizes the experts once, a chunk
at a time, for the bf16 blocks. Gate and up are separate stacks, so each expert's own Linear can
keep a view into them. `reference` is the plain loop the kernels must equal. Shared experts may be
folded into the stacks as pieces of a routed expert's width (models.deepseek.MoE.fold_shared): the
router then appends a slot of weight 1 per piece to every token, and they run in the same two
launches. The shapes follow vLLM's fused_moe (its sorted-token layout is the anchor); the code is
ours.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quantship.kernels import dependent_launch, wna16


@dataclass
class ExpertWeights:
    """One projection (gate, up or down) of every expert of a layer, stacked."""

    weight: torch.Tensor  # dense [E, out, in], or packed int32 [E, ceil(in/P), out]
    in_features: int
    scale: torch.Tensor | None = None  # [E, G, out] (packed only)
    zero: torch.Tensor | None = None  # [E, G, out] int8 (asymmetric only)
    bits: int = 0  # 0: dense
    group_size: int = 0

    @property
    def out_features(self) -> int:
        return self.weight.shape[1] if self.bits == 0 else self.weight.shape[2]

    def dense(self, expert: int) -> torch.Tensor:
        """Expert `expert`'s [out, in] matrix in float32."""
        if self.bits == 0:
            return self.weight[expert].float()
        zero = None if self.zero is None else self.zero[expert]
        return wna16.dequantize(self.weight[expert], self.scale[expert], zero, self.bits, self.in_features,
                                self.group_size)


def reference(x: torch.Tensor, gate: ExpertWeights, up: ExpertWeights, down: ExpertWeights, weights: torch.Tensor,
              indices: torch.Tensor) -> torch.Tensor:
    """x [N, H], routing weights/indices [N, k] → the routed experts' sum [N, H] (float32), one expert at a time."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(gate.weight.shape[0]):
        token, slot = torch.where(indices == e)
        if token.numel() == 0:
            continue
        act = F.silu(F.linear(x[token].float(), gate.dense(e))) * F.linear(x[token].float(), up.dense(e))
        out.index_add_(0, token, F.linear(act, down.dense(e)) * weights[token, slot, None].float())
    return out


BLOCK_N, BLOCK_K = 64, 64


DECODE_BLOCK_N = 64  # packed experts in decode blocks; measured on the H200 at V3's shapes: 32 was 1.3x slower at batch 32


def packed_block_k(bits: int, block_m: int, block_k: int = BLOCK_K) -> int:
    """K tile of packed experts in decode blocks: at least 16 word rows, the smallest tensor-core
    product of the per-value-position tiles (128 int4 values)."""
    return max(block_k, 16 * (32 // bits)) if bits and block_m <= 16 else block_k


def _spans(w: ExpertWeights, block_k: int) -> bool:
    """Whether a K tile may straddle quantization groups (then scales are gathered per word row)."""
    return bool(w.bits) and w.group_size < w.in_features and w.group_size % block_k != 0


def block_m_for(slots: int, num_experts: int) -> int:
    """Rows per block: 16 when experts see a few tokens each (decode), 64 when they see many (prefill)."""
    return 64 if slots >= 64 * num_experts else 16


ALIGN_IN_ONE_PROGRAM = 1024  # slots up to which one Triton program aligns them (decode); beyond, torch's sort


def align_by_expert(indices: torch.Tensor, num_experts: int, block_m: int,
                    one_program: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots sorted by expert, each expert's run padded to block_m: (sorted_ids [C], block_expert [C / block_m]).

    Padding entries hold the number of slots (a sentinel). Nothing is read on the host. A few slots
    (decode steps: at most ALIGN_IN_ONE_PROGRAM) are aligned by one Triton program, one launch; more
    by torch's ops (a sort), where one program's loop over the slots would take longer."""
    flat = indices.flatten()
    slots = flat.numel()
    capacity = -(-(slots + num_experts * (block_m - 1)) // block_m) * block_m
    if one_program if one_program is not None else slots <= ALIGN_IN_ONE_PROGRAM:
        from quantship.kernels._fused_moe_triton import align_kernel

        sorted_ids = torch.empty(capacity, dtype=torch.int32, device=flat.device)
        block_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=flat.device)
        experts = 1 << max(4, (num_experts - 1).bit_length())
        align_kernel[(1,)](flat.contiguous(), sorted_ids, block_expert, slots, num_experts, capacity, BLOCK_M=block_m,
                           EXPERTS=experts, CHUNK=max(16, 4096 // experts), num_warps=4,
                           **dependent_launch(flat, default_off=True))
        return sorted_ids, block_expert
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync to size its output
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = flat.argsort(stable=True)
    expert = flat[order]
    rank = torch.arange(slots, device=flat.device) - (counts.cumsum(0) - counts)[expert]
    sorted_ids = torch.full((capacity,), slots, dtype=torch.int32, device=flat.device)
    sorted_ids[(ends - padded)[expert] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, capacity, block_m, device=flat.device)
    block_expert = torch.searchsorted(ends, block_start, right=True).to(torch.int32)
    return sorted_ids, block_expert


def _pointers(w: ExpertWeights) -> tuple:
    return w.weight, w.weight if w.scale is None else w.scale, w.weight if w.zero is None else w.zero


# K splits of decode blocks (16 rows), finished in the kernel (wna16's workspace: no memset, no cast). 1:
# none. Measured on the H200 (kernel_fused_moe.py): a split of 4 is 1.6-1.9x faster than none where a
# step's few slots give about one program per multiprocessor, but there the slot GEMV is faster still;
# from 0.75 slots per expert on, where the blocks are taken, it is 0-7% slower. So it stays off.
DECODE_SPLIT_K = 1


def _k_split(k: int, block_k: int, split_k: int, device: torch.device, sums: int, tiles: int):
    """(inputs per split, splits, workspace or None) for one of the two launches; no split where the
    workspace cannot be had (growing it during CUDA-graph capture)."""
    per_split, splits = wna16.split_range(k, block_k, split_k)
    workspace = wna16.split_workspace(device, sums, tiles) if splits > 1 else None
    if workspace is None:
        return k, 1, None
    return per_split, splits, workspace


# Packed experts of a decode step whose slots mostly pick different experts run as one GEMV row per slot
# (moe_gemv_*: the dense GEMV's tile and table entry) instead of 16-row tensor-core blocks: up to this many
# slots per routed expert (V2-Lite: batch 1-8 of 64 experts top-6; V3: up to batch 24 of 256 top-8). A GEMV
# row reads its expert's weight once per slot, a block once per expert, so past it the blocks read less.
# Measured on the H200 (kernel_fused_moe.py): the GEMV 3.2-3.8x the blocks at V2-Lite batch 1, 1.2x at batch 8
# (0.75 slots per expert), 0.76x at 16 (1.5); at V3 3.1x at batch 1, 1.03x at 16 (0.5), 0.82x at 32 (1.0).
SLOT_GEMV_MAX_SHARE = 0.75


def uses_slot_gemv(slots: int, num_experts: int, bits: int) -> bool:
    return bits > 0 and slots <= SLOT_GEMV_MAX_SHARE * num_experts


def _slot_gemv(x: torch.Tensor, gate: ExpertWeights, up: ExpertWeights, down: ExpertWeights, weights: torch.Tensor,
               indices: torch.Tensor) -> torch.Tensor:
    """fused_moe for a few slots over packed experts, with the tiles of wna16's one-row GEMV entry: a
    program per (slot, output tile, K split), finished in the kernel (down sums each token's slots there)."""
    import triton

    from quantship.kernels._fused_moe_triton import moe_gemv_down_kernel, moe_gemv_gate_up_kernel

    n, hidden = x.shape
    inter, top_k = gate.out_features, indices.shape[1]
    slots = n * top_k
    # int4 experts and bf16 x on a GPU take the dense bf16x2 GEMV's tile and table entry, as one row does
    # (BLOCKS_BY_M's on every GPU: a GPU's own tiles, wna16.DEVICE_TILES, were swept on dense layers only)
    bf16x2 = gate.bits == 4 and down.bits == 4 and x.dtype == torch.bfloat16 and x.is_cuda
    blocks = wna16.choose_blocks(1, bf16x2)
    flat = indices.reshape(-1).contiguous()
    routing = weights.reshape(-1).float().contiguous()
    x = x.contiguous()

    common = dict(BLOCK_N=blocks.block_n, BLOCK_K=blocks.block_k, num_warps=blocks.num_warps,
                  num_stages=blocks.num_stages, **dependent_launch(x, default_off=True))
    act = torch.empty(slots, inter, dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(inter, blocks.block_n)
    per_split, splits = wna16.splits_for(blocks, slots * tiles, hidden, blocks.block_k)
    per_split, splits, workspace = _k_split(hidden, blocks.block_k, splits, x.device, 2 * slots * inter, slots * tiles)
    moe_gemv_gate_up_kernel[(slots, tiles, splits)](
        x, *_pointers(gate), *_pointers(up), act, flat, *(workspace or (act, flat)), slots, hidden, inter, top_k,
        max(gate.group_size, 1), per_split, BITS=gate.bits, HAS_ZERO=gate.zero is not None,
        SPANS=_spans(gate, blocks.block_k), SPLIT=workspace is not None, BF16X2=bf16x2, **common)
    # down: a program per (slot, tile, K split), the token's slots summed in the workspace (split or not);
    # without one (growing it during graph capture), a program per (token, tile) looping over its slots.
    out = torch.empty(n, hidden, device=x.device, dtype=x.dtype)
    tiles = triton.cdiv(hidden, blocks.block_n)
    per_split, splits = wna16.splits_for(blocks, slots * tiles, inter, blocks.block_k)
    workspace = wna16.split_workspace(x.device, n * hidden, n * tiles)
    if workspace is None:
        per_split, splits = inter, 1
    moe_gemv_down_kernel[(slots if workspace else n, tiles, splits)](
        act, *_pointers(down), out, flat, routing, *(workspace or (out, flat)), hidden, inter, top_k,
        max(down.group_size, 1), per_split, BITS=down.bits, HAS_ZERO=down.zero is not None,
        SPANS=_spans(down, blocks.block_k), SPLIT=workspace is not None, BF16X2=bf16x2, **common)
    return out


# Packed experts of a step that takes the prefill blocks (block_m_for: 64 slots per expert and more) are
# dequantized once into bf16 stacks and run through the bf16 blocks: the blocks' in-kernel dequantization
# repeats for every 64-row block of an expert and measured 2.6x (V2-Lite, 2,048 tokens) and 2.0x (V3) the
# bf16 blocks' time on the H200, dequantizing every expert once 0.7x and 0.8x of it (kernel_fused_moe.py).
DEQUANTIZE_BUDGET = 1 << 30  # bytes of dequantized experts one pass holds: the experts go in chunks of it


def dequantizes_experts(slots: int, num_experts: int, bits: int) -> bool:
    return bits > 0 and block_m_for(slots, num_experts) > 16


def dequantize_bytes(num_experts: int, hidden: int, inter: int, itemsize: int) -> int:
    """The largest buffer of dequantized experts a prefill step holds (the gate+up pass's chunk)."""
    per_expert = 2 * hidden * inter * itemsize
    return min(num_experts, max(1, DEQUANTIZE_BUDGET // per_expert)) * per_expert


def _expert_chunks(num_experts: int, per_expert: int) -> list[tuple[int, int]]:
    size = max(1, DEQUANTIZE_BUDGET // per_expert)
    return [(e, min(e + size, num_experts)) for e in range(0, num_experts, size)]


def _dequantized(w: ExpertWeights, begin: int, end: int, dtype: torch.dtype) -> ExpertWeights:
    """Experts begin .. end of a packed stack as dense [C, in, out] (the blocks read it with KN)."""
    zero = None if w.zero is None else w.zero[begin:end]
    dense = wna16.dequantize_transposed(w.weight[begin:end], w.scale[begin:end], zero, w.bits, w.in_features,
                                        max(w.group_size, 1), dtype)
    return ExpertWeights(dense, w.in_features)


@dataclass
class _Blocks:
    """What the gate/up and down launches of one call share: the aligned slots and the tiles."""

    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    slots: int
    top_k: int
    block_m: int
    block_n: int | None
    block_k: int
    split_k: int
    launch: dict


def _gate_up(b: _Blocks, x: torch.Tensor, gate: ExpertWeights, up: ExpertWeights, act: torch.Tensor,
             experts: tuple[int, int], kn: bool = False) -> None:
    """act = SiLU(x gate) * (x up) for the slots of experts experts[0] .. experts[1] (gate/up their stacks)."""
    import triton

    from quantship.kernels._fused_moe_triton import moe_gate_up_kernel

    hidden, inter, blocks = x.shape[1], act.shape[1], b.block_expert.numel()
    k_tile = packed_block_k(gate.bits, b.block_m, b.block_k)
    block_n = b.block_n or (DECODE_BLOCK_N if gate.bits and b.block_m <= 16 else BLOCK_N)
    tiles = triton.cdiv(inter, block_n)
    per_split, splits, workspace = _k_split(hidden, k_tile, b.split_k, x.device, 2 * b.slots * inter, blocks * tiles)
    moe_gate_up_kernel[(blocks, tiles, splits)](
        x, *_pointers(gate), *_pointers(up), act, b.sorted_ids, b.block_expert, *(workspace or (act, b.sorted_ids)),
        b.slots, experts[0], experts[1], hidden, inter, b.top_k, max(gate.group_size, 1), per_split, BITS=gate.bits,
        HAS_ZERO=gate.zero is not None, SPANS=_spans(gate, k_tile), SPLIT=workspace is not None, BLOCK_M=b.block_m,
        BLOCK_N=block_n, BLOCK_K=k_tile, KN=kn, **b.launch, **dependent_launch(b.sorted_ids, default_off=True))


def _down(b: _Blocks, act: torch.Tensor, down: ExpertWeights, routing: torch.Tensor, out: torch.Tensor,
          experts: tuple[int, int], kn: bool = False) -> None:
    """out = routing weight * (act down) for the slots of experts experts[0] .. experts[1]."""
    import triton

    from quantship.kernels._fused_moe_triton import moe_down_kernel

    inter, hidden, blocks = act.shape[1], out.shape[1], b.block_expert.numel()
    k_tile = packed_block_k(down.bits, b.block_m, b.block_k)
    block_n = b.block_n or (DECODE_BLOCK_N if down.bits and b.block_m <= 16 else BLOCK_N)
    tiles = triton.cdiv(hidden, block_n)
    per_split, splits, workspace = _k_split(inter, k_tile, b.split_k, act.device, b.slots * hidden, blocks * tiles)
    moe_down_kernel[(blocks, tiles, splits)](
        act, *_pointers(down), out, b.sorted_ids, b.block_expert, routing, *(workspace or (out, b.sorted_ids)),
        b.slots, experts[0], experts[1], hidden, inter, max(down.group_size, 1), per_split, BITS=down.bits,
        HAS_ZERO=down.zero is not None, SPANS=_spans(down, k_tile), SPLIT=workspace is not None, BLOCK_M=b.block_m,
        BLOCK_N=block_n, BLOCK_K=k_tile, KN=kn, **b.launch, **dependent_launch(b.sorted_ids, default_off=True))


def fused_moe(x: torch.Tensor, gate: ExpertWeights, up: ExpertWeights, down: ExpertWeights, weights: torch.Tensor,
              indices: torch.Tensor, block_n: int | None = None, block_k: int = BLOCK_K,
              split_k: int | None = None, slot_gemv: bool | None = None, block_m: int | None = None,
              launch: dict | None = None, dequantize: bool | None = None, shared: int = 0) -> torch.Tensor:
    """The routed experts' output [N, H] in x's dtype, through two Triton kernels. `shared`: the last
    that many experts of the stacks are shared experts folded in, which every token's last `shared`
    slots pick (routing.Routing.shared); the slot GEMV is chosen by all the slots, the blocks' height
    and dequantize-once by the routed slots.
    `split_k` (decode blocks only; default DECODE_SPLIT_K) splits each block's K over that many
    programs; `slot_gemv` (default: uses_slot_gemv) runs packed experts as a GEMV row per slot instead
    of blocks; `dequantize` (default: dequantizes_experts) dequantizes packed experts once, in chunks,
    for the bf16 blocks. `block_m` (default block_m_for) and `launch` (Triton's num_warps / num_stages)
    are for tile sweeps."""
    n, hidden = x.shape
    num_experts, inter, top_k = gate.weight.shape[0], gate.out_features, indices.shape[1]
    slots = n * top_k
    routed_slots, routed_experts = n * (top_k - shared), num_experts - shared
    # the slot GEMV re-reads a folded shared piece for every token, as it does a routed expert picked twice:
    # its choice counts them all; the blocks' height follows the routed experts' tokens
    if gate.bits and (uses_slot_gemv(slots, num_experts, gate.bits) if slot_gemv is None else slot_gemv):
        return _slot_gemv(x, gate, up, down, weights, indices)
    block_m = block_m or block_m_for(routed_slots, routed_experts)
    sorted_ids, block_expert = align_by_expert(indices, num_experts, block_m)
    b = _Blocks(sorted_ids, block_expert, slots, top_k, block_m, block_n, block_k,
                (DECODE_SPLIT_K if split_k is None else split_k) if block_m <= 16 else 1, launch or {})
    x = x.contiguous()
    routing = weights.reshape(-1).float().contiguous()
    act = torch.empty(slots, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(slots, hidden, device=x.device, dtype=x.dtype)
    if gate.bits and (dequantizes_experts(routed_slots, routed_experts, gate.bits) if dequantize is None
                      else dequantize):
        for begin, end in _expert_chunks(num_experts, 2 * hidden * inter * x.element_size()):
            _gate_up(b, x, _dequantized(gate, begin, end, x.dtype), _dequantized(up, begin, end, x.dtype), act,
                     (begin, end), kn=True)
        for begin, end in _expert_chunks(num_experts, hidden * inter * x.element_size()):
            _down(b, act, _dequantized(down, begin, end, x.dtype), routing, out, (begin, end), kn=True)
    else:
        _gate_up(b, x, gate, up, act, (0, num_experts))
        _down(b, act, down, routing, out, (0, num_experts))
    return out.view(n, top_k, hidden).sum(1).to(x.dtype)
