"""Round-to-nearest (RTN): the arithmetic every method shares.

Conventions are compressed-tensors': signed integers in [qmin, qmax]; symmetric scale =
max|w| / ((qmax - qmin) / 2); asymmetric scale = (max - min) / (qmax - qmin) with an integer
zero point, both ranges stretched to include 0. Scales are rounded to the checkpoint dtype
(bf16) before the integers are computed, so what is written dequantizes to what we measured.
"""

from __future__ import annotations

import torch

from quantship.quantized_tensor import FP8_MAX, QuantizedTensor, WeightQuant, expand_groups


def qparams(
    wmin: torch.Tensor, wmax: torch.Tensor, args: WeightQuant, scale_dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale and zero point from per-group minima and maxima (any shape)."""
    wmin = torch.minimum(wmin, torch.zeros_like(wmin))
    wmax = torch.maximum(wmax, torch.zeros_like(wmax))
    if args.type == "float":
        scale = torch.maximum(wmin.abs(), wmax) / FP8_MAX
        zero = None
    elif args.symmetric:
        scale = torch.maximum(wmin.abs(), wmax) / ((args.qmax - args.qmin) / 2)
        zero = None
    else:
        scale = (wmax - wmin) / (args.qmax - args.qmin)
    scale = scale.to(scale_dtype).float()
    # An all-zero group would divide by zero; any positive scale represents it exactly.
    scale = torch.where(scale > 0, scale, torch.full_like(scale, torch.finfo(scale_dtype).tiny))
    if args.type == "int" and not args.symmetric:
        zero = torch.clamp(torch.round(args.qmin - wmin / scale), args.qmin, args.qmax)
    return scale, zero


def quantize_values(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, args: WeightQuant) -> torch.Tensor:
    """w and scale/zero broadcastable; returns integers (as float) or float8-rounded values."""
    if args.type == "float":
        return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    q = torch.round(w / scale)
    if zero is not None:
        q = q + zero
    return q.clamp(args.qmin, args.qmax)


def minmax_by_group(w: torch.Tensor, args: WeightQuant) -> tuple[torch.Tensor, torch.Tensor]:
    out, inp = w.shape
    grouped = w.reshape(out, args.groups(inp), args.group_width(inp))
    return grouped.amin(dim=-1), grouped.amax(dim=-1)


def rtn_quantize(w: torch.Tensor, args: WeightQuant, scale_dtype: torch.dtype = torch.bfloat16) -> QuantizedTensor:
    w = w.float()
    scale, zero = qparams(*minmax_by_group(w, args), args, scale_dtype)
    inp = w.shape[1]
    zeros = None if zero is None else expand_groups(zero, inp, None)
    values = quantize_values(w, expand_groups(scale, inp, None), zeros, args)
    return QuantizedTensor(store_values(values, args), scale, None if zero is None else zero.to(torch.int8), args)


def store_values(values: torch.Tensor, args: WeightQuant) -> torch.Tensor:
    return values.to(torch.float8_e4m3fn) if args.type == "float" else values.to(torch.int8)
