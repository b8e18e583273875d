"""Linears held on the device as the checkpoint stores them, widened at each use.

The quantizer computes in float32, but a DeepSeek-V3 MoE layer's 768 routed-expert weights are 45 GB
in float32 against 22.5 GB in bf16 and 11.3 GB as the published FP8 blocks. `HeldLinear` keeps a
weight as it was read (bf16/fp16, or float8 values with their per-block `weight_scale_inv`), runs
forward by widening it to the input's dtype for that call, and hands the quantizer a float32 copy
when asked (`dequantized_weight`, as the quantized Linears name it), one Linear at a time. Widening
is exact (bf16 into float32) or the very dequantization the loader would have done up front (FP8
blocks), so results do not change.

AWQ changes the weights it searches without materialising them: its per-channel scales are folded
(`scale_columns`, `divide_rows`) as float32 products applied at every widening, in the order they
were folded, which is the arithmetic an in-place fold of a float32 weight does; and its search
swaps in a fake-quantized weight (`substitute`) that is computed per use, one expert at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from quantship.quantized_tensor import block_grid


class HeldLinear(nn.Linear):
    """An nn.Linear (so the quantizer finds it) whose weight keeps its stored dtype under `.to(dtype)`."""

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int] | None = None,
                 bias: bool = False):
        nn.Module.__init__(self)
        self.in_features, self.out_features, self.block = in_features, out_features, block
        # Built on the meta device and filled by the loader's load_state_dict(assign=True).
        self.register_buffer("weight", torch.empty(out_features, in_features, device="meta"))
        scale = None if block is None else torch.empty(block_grid((out_features, in_features), block), device="meta")
        self.register_buffer("weight_scale_inv", scale)
        self.bias = nn.Parameter(torch.empty(out_features, device="meta"), requires_grad=False) if bias else None
        self.folds: list[tuple[str, torch.Tensor]] = []  # ("columns", s): w × s; ("rows", s): w ÷ s per row
        self.substitute: Callable[[torch.Tensor], torch.Tensor] | None = None  # float32 weight → the one to use

    def scale_columns(self, s: torch.Tensor) -> None:
        """From now on the weight is w·diag(s) (s float32, one per input feature)."""
        self.folds.append(("columns", s))

    def divide_rows(self, s: torch.Tensor) -> None:
        """From now on the weight is diag(1/s)·w (s float32, one per output feature)."""
        self.folds.append(("rows", s[:, None]))

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if not self.folds and self.substitute is None:
            return self._widened(dtype)
        w = self._widened(torch.float32)
        for kind, s in self.folds:
            w = w * s if kind == "columns" else w / s
        return (w if self.substitute is None else self.substitute(w)).to(dtype)

    def _widened(self, dtype: torch.dtype) -> torch.Tensor:
        if self.weight_scale_inv is None:
            return self.weight.to(dtype)
        # The product dequantize_blocks computes, in a few whole-tensor ops: this runs for every expert
        # in every calibration batch, where a loop over block rows would launch dozens of small kernels.
        out, inp = self.weight.shape
        scale = self.weight_scale_inv.float().repeat_interleave(self.block[0], 0)[:out]
        return (self.weight.float() * scale.repeat_interleave(self.block[1], 1)[:, :inp]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized_weight(x.dtype), self.bias)

    def _apply(self, fn, recurse=True):
        # .to(device, dtype) moves the stored tensors but must not widen them (that is the point): they
        # are set aside while the bias follows fn, then moved to the device fn sends tensors to.
        weight, scale = self._buffers.pop("weight"), self._buffers.pop("weight_scale_inv")
        super()._apply(fn, recurse)
        device = fn(weight.new_empty(0)).device
        self.register_buffer("weight", weight.to(device))
        self.register_buffer("weight_scale_inv", None if scale is None else scale.to(device))
        self.folds = [(kind, s.to(device)) for kind, s in self.folds]
        return self

    def extra_repr(self) -> str:
        held = f"fp8 blocks {self.block[0]}x{self.block[1]}" if self.block else str(self.weight.dtype)
        folds = f", {len(self.folds)} scale folds" if self.folds else ""
        return f"in={self.in_features}, out={self.out_features}, held as {held}{folds}"


def float32_weight(module: nn.Linear) -> torch.Tensor:
    """A Linear's weight in float32 (a held one widened now; any other as it is)."""
    return module.dequantized_weight() if isinstance(module, HeldLinear) else module.weight.data
