"""GPTQ onto a grid that someone else defines: the column loop of gptq.py, with the rounding grid
chosen per block of columns by a callback (llama.cpp's blocks of 32 or super-blocks of 256).

A grid block is fitted from the *error-updated* weights when the loop reaches its first column
(as gptq.py does for groups), then every column of the block is rounded onto it and its error
pushed onto the columns not yet quantized. The grid is affine per element: value = step * code - low
with integer codes in [lo, hi], which covers every llama.cpp block type quantship writes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from quantship.quant.gptq import _inverse_cholesky


@dataclass
class GridBlock:
    """A fitted block: per-element step and low [M, width], code range, and whatever the packer needs."""

    step: torch.Tensor
    low: torch.Tensor
    lo: int
    hi: int
    params: dict


def gptq_on_grid(weights: torch.Tensor, hessians: torch.Tensor, width: int,
                 fit: Callable[[torch.Tensor], GridBlock], dampening: float = 0.01,
                 lazy_block: int = 128) -> tuple[torch.Tensor, torch.Tensor, list[GridBlock]]:
    """weights [B, R, n], hessians [B, n, n] → (codes [B, R, n], dequantized [B, R, n], fitted blocks in order).

    `fit` gets the current weights of one grid block as [B*R, width] rows.
    """
    w = weights.detach().float().clone()
    h = hessians.detach().float().clone()
    b, rows, n = w.shape
    if n % width:
        raise ValueError(f"row length {n} is not a multiple of the grid block {width}")
    diag = torch.diagonal(h, dim1=1, dim2=2)
    dead = diag == 0  # columns no calibration token touched: invertible H, quantized as zero
    diag += dead.float()
    w *= (~dead)[:, None, :]
    u = _inverse_cholesky(h, dampening)
    lazy_block = width * max(1, lazy_block // width)  # a grid block must sit inside one lazy block
    codes = torch.zeros_like(w)
    dq = torch.zeros_like(w)
    fitted: list[GridBlock] = []
    for b1 in range(0, n, lazy_block):
        b2 = min(b1 + lazy_block, n)
        w1 = w[:, :, b1:b2].clone()
        u1 = u[:, b1:b2, b1:b2]
        err1 = torch.zeros_like(w1)
        block = None
        for i in range(b2 - b1):
            if i % width == 0:
                block = fit(w1[:, :, i:i + width].reshape(b * rows, width))
                fitted.append(block)
            k = i % width
            step = block.step[:, k].view(b, rows)
            low = block.low[:, k].view(b, rows)
            safe = torch.where(step == 0, torch.ones_like(step), step)
            c = torch.where(step == 0, torch.full_like(step, float(block.lo)),
                            torch.round((w1[:, :, i] + low) / safe)).clamp(block.lo, block.hi)
            value = step * c - low
            codes[:, :, b1 + i], dq[:, :, b1 + i] = c, value
            err = (w1[:, :, i] - value) / u1[:, i, i][:, None]
            w1[:, :, i:] -= err[:, :, None] * u1[:, i, None, i:]
            err1[:, :, i] = err
        w[:, :, b2:] -= err1 @ u[:, b1:b2, b2:]
    return codes, dq, fitted
