"""GPTQ (Frantar et al. 2022): quantize one column at a time and push its rounding error onto the
columns not yet quantized, weighted by the inverse Hessian of the layer's inputs.

The Hessian is H = sum of x xᵀ over calibration tokens; its overall scale cancels out (the error
is divided by a diagonal entry of chol(H⁻¹) and multiplied by the same row). Scales, zero points
and integers come from rtn.py, so a GPTQ tensor is stored and dequantized exactly like an RTN one.
"""

from __future__ import annotations

import torch

from quantship.quant.rtn import QuantizedTensor, store_values, minmax_by_group, qparams, quantize_values
from quantship.quant.scheme import WeightQuant

_RETRIES = 4  # dampening tried: d, 10d, 100d, 1000d


def _inverse_cholesky(h: torch.Tensor, dampening: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp·I)⁻¹, raising dampening until both factorizations succeed."""
    mean_diag = torch.diag(h).mean()
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    for attempt in range(_RETRIES):
        damp = dampening * 10**attempt
        lower, info = torch.linalg.cholesky_ex(h + damp * mean_diag * eye)
        if info.item() == 0:
            upper, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(lower), upper=True)
            if info.item() == 0 and torch.isfinite(upper).all():
                return upper
    raise ValueError(
        f"GPTQ: Hessian is not positive definite even with dampening {damp:g} x mean(diag(H)); "
        "collect more calibration tokens or raise dampening"
    )


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    args: WeightQuant,
    *,
    block_size: int = 128,
    dampening: float = 0.01,
    scale_dtype: torch.dtype = torch.bfloat16,
) -> QuantizedTensor:
    """Quantize weight [out, in] given the input Hessian [in, in]; returns values in original column order."""
    w = weight.detach().to(torch.float32).clone()
    h = hessian.detach().to(device=w.device, dtype=torch.float32).clone()
    out, n = w.shape
    if h.shape != (n, n):
        raise ValueError(f"GPTQ: Hessian shape {tuple(h.shape)} does not match weight in_features {n}")
    if not (torch.isfinite(w).all() and torch.isfinite(h).all()):
        raise ValueError("GPTQ: weight or Hessian contains NaN/inf")
    width = args.group_width(n)
    if n % width:
        raise ValueError(f"GPTQ: in_features {n} is not a multiple of group size {width}")

    # Columns no calibration token ever touched carry no information: make H invertible there and
    # quantize them as zero (the paper's reference does the same).
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0

    grouped = args.strategy == "group"
    # Fixed parameters (channel strategy, or static act-order) come from the original weights in the
    # original group layout; otherwise each group's parameters are taken from its error-updated
    # weights when the loop reaches its first column.
    fixed = not grouped or args.actorder == "static"
    scale = torch.zeros(out, args.groups(n), device=w.device)
    zero = None if args.symmetric or args.type == "float" else torch.zeros_like(scale)
    if fixed:
        scale, zero = qparams(*minmax_by_group(w, args), args, scale_dtype)

    perm = torch.arange(n, device=w.device)
    if args.actorder in ("static", "group"):
        # Quantize the most-activated columns first, while there is most freedom left to absorb error.
        perm = torch.argsort(torch.diag(h), descending=True)
        w, h = w[:, perm], h[perm][:, perm]
    # Parameter column used by each (permuted) column.
    col_group = perm // width if fixed else torch.arange(n, device=w.device) // width

    u = _inverse_cholesky(h, dampening)
    if not fixed:
        # A group must sit inside one block so its "current" weights include every earlier update;
        # block size only affects speed, not the result.
        block_size = width * max(1, block_size // width)

    q = torch.zeros_like(w)
    for b1 in range(0, n, block_size):
        b2 = min(b1 + block_size, n)
        w1 = w[:, b1:b2].clone()
        u1 = u[b1:b2, b1:b2]
        err1 = torch.zeros_like(w1)
        for i in range(b2 - b1):
            j = b1 + i
            if not fixed and j % width == 0:
                g = j // width
                s, z = qparams(w1[:, i : i + width].amin(1), w1[:, i : i + width].amax(1), args, scale_dtype)
                scale[:, g] = s
                if zero is not None:
                    zero[:, g] = z
            s = scale[:, col_group[j]]
            z = None if zero is None else zero[:, col_group[j]]
            q[:, j] = quantize_values(w1[:, i], s, z, args)
            dq = (q[:, j] - (0 if z is None else z)) * s
            err = (w1[:, i] - dq) / u1[i, i]
            # Compensate the rest of this block now; later blocks get one batched update below.
            w1[:, i:] -= err.unsqueeze(1) * u1[i, i:].unsqueeze(0)
            err1[:, i] = err
        w[:, b2:] -= err1 @ u[b1:b2, b2:]

    inv = torch.argsort(perm)
    g_idx = None
    if grouped and args.actorder == "group":
        g_idx = col_group[inv].to(torch.int32)  # compressed-tensors' weight_g_idx: group of each original column
    return QuantizedTensor(
        store_values(q[:, inv], args), scale, None if zero is None else zero.to(torch.int8), args, g_idx
    )
