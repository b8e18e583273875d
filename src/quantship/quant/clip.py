"""AWQ's second half: shrink each group's weight range where that lowers the Linear's output error.

Rounding error grows with the range a group must cover; clipping the few largest weights of a
group trades a small clipping error for a finer grid for all the others. Per output row and
group, the shrink factor is chosen on the Linear's real calibration inputs.
"""

from __future__ import annotations

import torch

from quantship.quant.rtn import rtn_quantize
from quantship.quantized_tensor import WeightQuant

# The search's largest intermediate is tokens x rows x groups float32 errors, with a few alive at once;
# rows are searched in chunks that keep each near this size. In one pass, DeepSeek-V3's dense
# gate_proj (18432 x 7168, group 128) over the 512 kept tokens would take 2.1 GB per intermediate.
CHUNK_BYTES = 256 << 20


@torch.no_grad()
def clip_weight(weight: torch.Tensor, x: torch.Tensor, args: WeightQuant, *, steps: int = 10,
                max_shrink: float = 0.5, chunk_bytes: int = CHUNK_BYTES) -> tuple[torch.Tensor, float]:
    """weight [out, in], x [n, in] → (clipped weight, mean chosen shrink). Never worse than no clipping.

    Every output row is searched on its own (group and channel scales are per row), so searching the rows
    in chunks gives what one pass would, in bounded memory."""
    out, inp = weight.shape
    x = x.float().to(weight.device)
    groups = inp // args.group_width(inp)
    rows = max(1, chunk_bytes // (4 * x.shape[0] * groups))
    chunks = [_clip_rows(weight[r:r + rows].float(), x, args, steps, max_shrink) for r in range(0, out, rows)]
    clipped = torch.cat([c for c, _ in chunks]).to(weight.dtype)
    return clipped, float(torch.cat([ratio.flatten() for _, ratio in chunks]).mean())


def _clip_rows(w: torch.Tensor, x: torch.Tensor, args: WeightQuant, steps: int,
               max_shrink: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(clipped rows, chosen shrink per row and group) for float32 rows w [rows, in]."""
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
        err = torch.einsum("ngk,ogk->nog", xg, diff.view(out, groups, width)).pow_(2).mean(0)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better[..., None], clipped, best)
        best_ratio = torch.where(better, torch.full_like(best_ratio, ratio), best_ratio)
    return best.view(out, inp), best_ratio
