"""The int4 GEMV on tensor cores (wna16's kind "gemv_mma", _mma_gemv_triton.py): 1 to 16 rows of bf16 x on a GPU
with mma.sync (compute capability 8.0 on), the weight in wna16's layout as it is held (no second copy).

Its inline PTX takes each thread's 4 elements of an operand as one lane's fragment of a warp's product, which holds
only where Triton lays the operands out as asked: the compile test checks the layout this Triton gives, and
`takes` checks each tile's results once per device against the dequantize reference before the kernel serves
(never during CUDA-graph capture: calls before an eager call has checked it take the CUDA-core GEMV)."""

from __future__ import annotations

import torch

from quantship.kernels import capability_major, dependent_launch
from quantship.kernels.wna16 import Blocks, pack, reference_matmul, split_outputs

ROWS = 16  # x's rows as the products' columns: one block of 8 up to 8 rows, two up to 16
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


def group_steps(group_size: int, k: int) -> int:
    """K steps a program sums before scaling: 4, or fewer that divide the group (its scale is one per group)."""
    if group_size >= k:
        return 4
    per_group = group_size // STEP
    return next(d for d in (4, 3, 2, 1) if per_group % d == 0)


def matmul(x2: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, k: int,
           group_size: int, blocks: Blocks, gated: bool = False) -> torch.Tensor:
    """y [M, N] in x's dtype: a program per block_n outputs (a multiple of 128) and block_k inputs (whole K steps,
    a multiple of the group's), K split over programs and finished in the kernel as the GEMVs finish it."""
    from quantship.kernels._mma_gemv_triton import WARPS, wna16_mma_gemv_kernel

    m, n = x2.shape[0], packed.shape[1]
    per_group = group_steps(group_size, k)
    steps = max(per_group, blocks.block_k // STEP // per_group * per_group)
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
        GROUP_STEPS=per_group, STEPS=steps, COLS=8 if m <= 8 else 16, num_warps=WARPS, **dependent_launch(x2))
    return y.to(x2.dtype)


_CHECKED: dict[tuple, bool] = {}


def takes(x2: torch.Tensor, packed: torch.Tensor, bits: int, group_size: int, k: int, blocks: Blocks) -> bool:
    """fits, and this device's Triton gave the tile's results as the reference's (checked once per tile)."""
    if not fits(x2, packed, bits, group_size, k):
        return False
    key = (x2.device, blocks)
    if key not in _CHECKED:
        if torch.cuda.is_current_stream_capturing():
            return False
        _CHECKED[key] = agrees(x2.device, blocks)
    return _CHECKED[key]


def agrees(device: torch.device, blocks: Blocks) -> bool:
    """The tile against dequantize + matmul in float32 on random weights: 1, 3, 8 and 13 rows, symmetric and with zero
    points, groups of 32 and 128, a partial last output tile and K split, plain and gated x; within bf16 rounding of
    x's products (the weight's values and x are exact in the tensor core, sums in float32)."""
    g = torch.Generator().manual_seed(0)
    n, k = blocks.block_n + 68, 2 * blocks.block_k + 3 * 128
    worst = 0.0
    for group, asym in ((128, False), (32, True)):
        packed = pack(torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8), 4).to(device)
        scale = (torch.rand(k // group, n, generator=g) * 0.1 + 0.01).to(device, torch.bfloat16)
        zero = torch.randint(-8, 8, (k // group, n), generator=g, dtype=torch.int8).to(device) if asym else None
        for m in (1, 3, 8, 13):
            for gated in (False, True):
                x = torch.randn(m, 2 * k if gated else k, generator=g).to(device, torch.bfloat16)
                x_in = (torch.nn.functional.silu(x[:, :k]) * x[:, k:]) if gated else x
                ref = reference_matmul(x_in, packed, scale, zero, 4, k, group)
                out = matmul(x, packed, scale, zero, k, group, blocks, gated).float()
                worst = max(worst, ((out - ref).norm() / ref.norm()).item())
    return worst < 1e-2
