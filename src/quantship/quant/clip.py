"""AWQ's second half: shrink each group's weight range where that lowers the Linear's output error.

Rounding error grows with the range a group must cover; clipping the few largest weights of a
group trades a small clipping error for a finer grid for all the others. Per output row and
group, the shrink factor is chosen on the Linear's real calibration inputs.
"""

from __future__ import annotations

import torch

from quantship.quant.rtn import rtn_quantize
from quantship.quantized_tensor import WeightQuant


@torch.no_grad()
def clip_weight(weight: torch.Tensor, x: torch.Tensor, args: WeightQuant, *, steps: int = 10,
                max_shrink: float = 0.5) -> tuple[torch.Tensor, float]:
    """weight [out, in], x [n, in] → (clipped weight, mean chosen shrink). Never worse than no clipping."""
    w = weight.float()
    x = x.float().to(w.device)
    out, inp = w.shape
    width = args.group_width(inp)
    groups = inp // width
    wg = w.view(out, groups, width)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    xg = x.view(-1, groups, width)
    best_err = torch.full((out, groups), float("inf"), device=w.device)
    best = wg.clone()
    best_ratio = torch.ones(out, groups, device=w.device)
    for step in range(steps + 1):
        ratio = 1.0 - max_shrink * step / steps
        clipped = torch.maximum(torch.minimum(wg, hi * ratio), lo * ratio)
        diff = w - rtn_quantize(clipped.view(out, inp), args).dequantize()
        # Error of each group's contribution to each output: mean over tokens of (x_g · d_g)².
        err = torch.einsum("ngk,ogk->nog", xg, diff.view(out, groups, width)).pow(2).mean(0)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better[..., None], clipped, best)
        best_ratio = torch.where(better, torch.full_like(best_ratio, ratio), best_ratio)
    return best.view(out, inp).to(weight.dtype), float(best_ratio.mean())
