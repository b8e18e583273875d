"""Linears that read the same input, merged into one matmul when a model is served.

Attention's q, k and v projections (MLA: the queries' first projection and the latent's) and an MLP's
gate and up projections each read one input. Run as one Linear over their stacked weights, a decode
step launches one kernel instead of three (or two) and reads the weights in one longer pass, which
is what small batches are bound by. The math is unchanged: each output is the same row times the
same input. Quantized Linears merge where their packed layouts stack (PackedLinear, same bits and
groups); anything else, and routed experts (the fused MoE kernels read them per expert), stays as
it is. The quantizer, the verifier and the exporters work on unmerged models: only the engine merges.
"""

from __future__ import annotations

import torch
from torch import nn

from quantship.models.layers import SharedInput
from quantship.models.quantized import PackedLinear


class MergedLinear(nn.Module):
    """One Linear computing several outputs side by side; forward returns them split."""

    def __init__(self, linear: nn.Module, sizes: list[int]):
        super().__init__()
        self.linear, self.sizes = linear, sizes

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(x).split(self.sizes, dim=-1)


def concatenate(linears: list[nn.Module]) -> nn.Module | None:
    """One module whose output is every Linear's side by side, or None where they cannot share one."""
    biases = [linear.bias is not None for linear in linears]
    if len(set(biases)) > 1:
        return None
    if all(type(linear) is nn.Linear for linear in linears):
        weights = [linear.weight for linear in linears]
        if len({(w.dtype, w.device) for w in weights}) > 1:
            return None
        merged = nn.Linear(weights[0].shape[1], sum(w.shape[0] for w in weights), bias=biases[0], device="meta")
        merged.weight = nn.Parameter(torch.cat(weights), requires_grad=False)
        if biases[0]:
            merged.bias = nn.Parameter(torch.cat([linear.bias for linear in linears]), requires_grad=False)
        return merged
    if all(type(linear) is PackedLinear for linear in linears):
        shared = {(p.bits, p.group_size, p.in_features, p.weight_zero_point is None, p.weight_scale.dtype)
                  for p in linears}
        return PackedLinear.concatenated(linears) if len(shared) == 1 else None
    return None


def merge_projections(model: nn.Module) -> int:
    """Merge, in place, the Linears of every module that declares a shared input (routed experts
    excepted); returns how many modules were merged."""
    count = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, SharedInput) or ".experts." in f".{name}." or getattr(module, "merged", None):
            continue
        names = module.input_names()
        parts = [getattr(module, n) for n in names]
        merged = concatenate(parts)
        if merged is None:
            continue
        for n in names:
            delattr(module, n)
        module.merged = MergedLinear(merged, [p.out_features for p in parts])
        count += 1
    return count
