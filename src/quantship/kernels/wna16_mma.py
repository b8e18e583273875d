"""The int4 GEMV on tensor cores (wna16's kind "gemv_mma", _mma_gemv_triton.py): 1 to 16 rows of bf16 x on a GPU
with mma.sync (compute capability 8.0 on), the weight in wna16's layout as it is held (no second copy).

Its inline PTX takes each thread's 4 elements of an operand as one lane's fragment of a warp's product, which holds
only where Triton lays the operands out as asked: the compile test checks the layout this Triton gives, and
`takes` checks the first call of each compiled kind per device against the dequantize reference before the kernel
serves it."""

from __future__ import annotations

import torch

from quantship.kernels import capability_major, dependent_launch
from quantship.kernels.elementwise import reference_silu_mul
from quantship.kernels.wna16 import Blocks, checked_once, reference_matmul, split_outputs

ROWS = 16  # x's rows as the products' columns: one block of 8 up to 8 rows, two up to 16
WARPS = 4  # a program's warps (the kernel's WARPS; here so that checking a tile imports no Triton)
STEP = 32  # inputs a K step: 4 word rows, one per lane of a quad


def fits(x2: torch.Tensor, packed: torch.Tensor, bits: int, group_size: int, k: int) -> bool:
    """Whether the kernel takes x2 [M, K] (or [M, 2K] gated) and the weight: int4, bf16 x on a GPU with mma.sync
    for bf16, at most 16 rows, whole K steps, groups of whole K steps, the words held along N (contiguous rows of
    N words, N a multiple of 4: each thread loads 4 words as one 16-byte vector) and x's rows read as bf16 pairs."""
    return (bits == 4 and x2.is_cuda and x2.dtype == torch.bfloat16 and capability_major(x2) >= 8
            and x2.shape[0] <= ROWS and k % STEP == 0 and (group_size >= k or group_size % STEP == 0)
            and packed.stride(1) == 1 and packed.shape[1] % 4 == 0 and packed.stride(0) % 4 == 0
            and packed.data_ptr() % 16 == 0 and x2.stride(1) == 1 and x2.stride(0) % 2 == 0
            and x2.data_ptr() % 4 == 0)


def tile_fits(blocks: Blocks) -> bool:
    """Whether the kernel can run in these tiles: outputs whole reps of its warps' 32 each, a K step deep at least,
    its words in 1 or 2 stages of registers (num_stages 2: a group's loads issued while the one before computes)."""
    return blocks.block_n % (32 * WARPS) == 0 and blocks.block_k >= STEP and blocks.num_stages in (1, 2)


def group_steps(group_size: int, k: int) -> int:
    """K steps a program sums before scaling: 4, or fewer that divide the group (its scale is one per group)."""
    if group_size >= k:
        return 4
    per_group = group_size // STEP
    return next(d for d in (4, 3, 2, 1) if per_group % d == 0)


def _steps(blocks: Blocks, group_size: int, k: int) -> int:
    """K steps a program takes: blocks.block_k's, a whole number of the group's (at least one group's)."""
    per_group = group_steps(group_size, k)
    return max(per_group, blocks.block_k // STEP // per_group * per_group)


def matmul(x2: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, k: int,
           group_size: int, blocks: Blocks, gated: bool = False) -> torch.Tensor:
    """y [M, N] in x's dtype: a program per block_n outputs (a multiple of 128) and block_k inputs (whole K steps,
    a multiple of the group's), K split over programs and finished in the kernel as the GEMVs finish it."""
    from quantship.kernels._mma_gemv_triton import wna16_mma_gemv_kernel

    m, n = x2.shape[0], packed.shape[1]
    per_group, steps = group_steps(group_size, k), _steps(blocks, group_size, k)
    per_split = STEP * steps
    splits = -(-k // per_split)
    tiles = -(-n // blocks.block_n)
    if splits > 1:
        y, sums, counters = split_outputs(x2, n, tiles, blocks.finish)
    else:
        y = sums = counters = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    product = torch.empty((m, k), dtype=x2.dtype, device=x2.device) if gated else x2  # SwiGLU's, made in the kernel
    wna16_mma_gemv_kernel[(tiles, splits)](
        x2, packed, scale, zero if zero is not None else scale, y, sums, counters, product, m, n, k, x2.stride(0),
        packed.stride(0), group_size, per_split, HAS_ZERO=zero is not None, ATOMIC=splits > 1, FINISH=sums is not y,
        GATED=gated, EVEN_K=k % per_split == 0, EVEN_N=n % blocks.block_n == 0, REPS=blocks.block_n // 32,
        GROUP_STEPS=per_group, STEPS=steps, COLS=8 if m <= 8 else 16, PREFETCH=blocks.num_stages > 1,
        SCALED=blocks.scaled_values,
        num_warps=WARPS, **dependent_launch(x2),
        **({"maxnreg": blocks.max_registers} if blocks.max_registers else {}))
    return y.to(x2.dtype)


_CHECKED: dict[tuple, bool] = {}
CHECKED_OUTPUTS = 1024  # outputs of a call compared with the reference: every lane's and warp's, several programs'


def specialization(*args) -> tuple:
    """What Triton compiles a launch for besides its constexprs, from the arguments as they are passed: each integer's
    being 1 or a multiple of 16, each tensor's address being 16-byte aligned. Alignment decides how Triton lays out
    the loads' tensors, and the layout decides which lane holds what, which the kernel's PTX relies on."""
    return tuple(a.data_ptr() % 16 == 0 if isinstance(a, torch.Tensor) else (a == 1, a % 16 == 0) for a in args)


def takes(x2: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int,
          group_size: int, k: int, blocks: Blocks, gated: bool = False) -> bool:
    """fits, and the kernel as compiled for this call (its tiles, constexprs and Triton's specialization of its
    arguments) gave this call's own result (its first CHECKED_OUTPUTS outputs) within bf16 rounding of dequantize +
    matmul in float32: checked on the first call of each such kind per device (never during CUDA-graph capture:
    until an eager call has checked it, the shared table's kernel takes them)."""
    if not (tile_fits(blocks) and fits(x2, packed, bits, group_size, k)):
        return False
    if blocks.scaled_values and scale.dtype != torch.bfloat16:  # its products take the scales as bf16 operands
        return False
    m, n = x2.shape[0], packed.shape[1]
    per_split = STEP * _steps(blocks, group_size, k)
    key = (x2.device, blocks, gated, zero is not None, m <= 8, k % per_split == 0, n % blocks.block_n == 0,
           specialization(x2, packed, scale, *(() if zero is None else (zero,)), m, n, k, x2.stride(0),
                          packed.stride(0), group_size, per_split))

    def agrees() -> bool:
        x_in = reference_silu_mul(x2[:, :k], x2[:, k:]) if gated else x2  # bf16 ops, rounded as the kernel's
        # the first outputs' reference only: dequantizing the whole weight in float32 would take 4 bytes a weight
        # (360 MB for a 6.7B layer's gate and up) at engine start, next to a KV cache sized to the memory left
        cols = min(n, CHECKED_OUTPUTS)
        ref = reference_matmul(x_in, packed[:, :cols], scale[:, :cols], None if zero is None else zero[:, :cols],
                               bits, k, group_size)
        out = matmul(x2, packed, scale, zero, k, group_size, blocks, gated)[:, :cols].float()
        error = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        return error < 1e-2  # a lane holding other values than its PTX assumes is off by order 1

    return checked_once(_CHECKED, key, agrees)
