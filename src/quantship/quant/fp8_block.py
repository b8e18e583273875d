"""FP8 block quantization: float8 e4m3 weights, one float32 scale per 2-D block (DeepSeek's and
llm-compressor's FP8_BLOCK). Data-free: each block is scaled so its largest magnitude maps to 448."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quantship.quantized_tensor import FP8_MAX, block_grid

DEFAULT_BLOCK = (128, 128)


def block_quantize(w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] → (values float8_e4m3fn [out, in], scale float32 [ceil(out/b0), ceil(in/b1)]).

    Edge blocks are partial: they are padded with zeros, which never raise a block's maximum."""
    out, inp = w.shape
    rows, cols = block_grid((out, inp), block)
    padded = F.pad(w.float(), (0, cols * block[1] - inp, 0, rows * block[0] - out))
    blocks = padded.view(rows, block[0], cols, block[1])
    scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
    # An all-zero block would divide by zero; any positive scale represents it exactly.
    scale = torch.where(scale > 0, scale, torch.full_like(scale, torch.finfo(torch.float32).tiny))
    values = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values.view(rows * block[0], cols * block[1])[:out, :inp].contiguous(), scale

