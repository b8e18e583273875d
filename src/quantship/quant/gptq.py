"""GPTQ (Frantar et al. 2022): quantize one column at a time and push its rounding error onto the
columns not yet quantized, weighted by the inverse Hessian of the layer's inputs.

The Hessian is H = sum of x xᵀ over calibration tokens; its overall scale cancels out (the error
is divided by a diagonal entry of chol(H⁻¹) and multiplied by the same row). Scales, zero points
and integers come from rtn.py, so a GPTQ tensor is stored and dequantized exactly like an RTN one.

The core is batched: a stack of same-shaped weights (a layer's 64 experts, or q/k/v/o) goes
through one column loop, which is what makes MoE models fast on a GPU.
"""

from __future__ import annotations

import torch

from quantship.quant.rtn import minmax_by_group, qparams, quantize_values, store_values
from quantship.quantized_tensor import QuantizedTensor, WeightQuant

_RETRIES = 4  # dampening tried: d, 10d, 100d, 1000d


def _inverse_cholesky(h: torch.Tensor, dampening: float) -> torch.Tensor:
    """Upper Cholesky factors of (H + damp·I)⁻¹ for H [B, n, n], raising dampening where needed."""
    mean_diag = torch.diagonal(h, dim1=1, dim2=2).mean(-1)
    eye = torch.eye(h.shape[-1], dtype=h.dtype, device=h.device)
    result = torch.empty_like(h)
    todo = torch.arange(h.shape[0], device=h.device)
    for attempt in range(_RETRIES):
        damp = dampening * 10**attempt
        lower, info = torch.linalg.cholesky_ex(h[todo] + (damp * mean_diag[todo])[:, None, None] * eye)
        upper, info2 = torch.linalg.cholesky_ex(torch.cholesky_inverse(lower), upper=True)
        ok = (info == 0) & (info2 == 0) & torch.isfinite(upper).flatten(1).all(-1)
        result[todo[ok]] = upper[ok]
        todo = todo[~ok]
        if len(todo) == 0:
            return result
    raise ValueError(
        f"GPTQ: Hessian is not positive definite even with dampening {damp:g} x mean(diag(H)); "
        "collect more calibration tokens or raise dampening"
    )


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, args: WeightQuant, **kwargs) -> QuantizedTensor:
    """Quantize weight [out, in] given the input Hessian [in, in]; returns values in original column order."""
    return gptq_quantize_many(weight[None], hessian[None], args, **kwargs)[0]


def gptq_quantize_many(
    weights: torch.Tensor,
    hessians: torch.Tensor,
    args: WeightQuant,
    *,
    block_size: int = 128,
    dampening: float = 0.01,
    scale_dtype: torch.dtype = torch.bfloat16,
) -> list[QuantizedTensor]:
    """weights [B, out, in], hessians [B, in, in] → B quantized tensors, one column loop for all."""
    w = weights.detach().to(torch.float32).clone()
    h = hessians.detach().to(device=w.device, dtype=torch.float32).clone()
    b, out, n = w.shape
    if h.shape != (b, n, n):
        raise ValueError(f"GPTQ: Hessian shape {tuple(h.shape)} does not match weight in_features {n}")
    if not (torch.isfinite(w).all() and torch.isfinite(h).all()):
        raise ValueError("GPTQ: weight or Hessian contains NaN/inf")
    if args.actorder not in (None, "static"):
        raise ValueError(f"GPTQ: actorder must be None or 'static', got {args.actorder!r}")
    width = args.group_width(n)
    if n % width:
        raise ValueError(f"GPTQ: in_features {n} is not a multiple of group size {width}")

    # Columns no calibration token ever touched carry no information: make H invertible there and
    # quantize them as zero (the paper's reference does the same).
    diag = torch.diagonal(h, dim1=1, dim2=2)
    dead = diag == 0
    diag += dead.float()
    w *= (~dead)[:, None, :]

    grouped = args.strategy == "group"
    # Fixed parameters (channel strategy, or static act-order) come from the original weights in the
    # original group layout; otherwise each group's parameters are taken from its error-updated
    # weights when the loop reaches its first column.
    fixed = not grouped or args.actorder == "static"
    scale = torch.zeros(b, out, args.groups(n), device=w.device)
    zero = None if args.symmetric or args.type == "float" else torch.zeros_like(scale)
    if fixed:
        scale, zero = qparams(*minmax_by_group(w.view(b * out, n), args), args, scale_dtype)
        scale = scale.view(b, out, -1)
        zero = None if zero is None else zero.view(b, out, -1)

    perm = torch.arange(n, device=w.device).expand(b, n)
    if args.actorder == "static":
        # Quantize the most-activated columns first, while there is most freedom left to absorb error.
        perm = torch.argsort(torch.diagonal(h, dim1=1, dim2=2), dim=-1, descending=True)
        w = w.gather(2, perm[:, None, :].expand(b, out, n))
        h = h.gather(1, perm[:, :, None].expand(b, n, n)).gather(2, perm[:, None, :].expand(b, n, n))
    # Parameter column used by each (permuted) column.
    col_group = perm // width if fixed else (torch.arange(n, device=w.device) // width).expand(b, n)

    u = _inverse_cholesky(h, dampening)
    if not fixed:
        # A group must sit inside one block so its "current" weights include every earlier update;
        # block size only affects speed, not the result.
        block_size = width * max(1, block_size // width)

    q = torch.zeros_like(w)
    for b1 in range(0, n, block_size):
        b2 = min(b1 + block_size, n)
        w1 = w[:, :, b1:b2].clone()
        u1 = u[:, b1:b2, b1:b2]
        err1 = torch.zeros_like(w1)
        for i in range(b2 - b1):
            j = b1 + i
            if not fixed and j % width == 0:
                g = j // width
                s, z = qparams(w1[:, :, i:i + width].amin(-1), w1[:, :, i:i + width].amax(-1), args, scale_dtype)
                scale[:, :, g] = s
                if zero is not None:
                    zero[:, :, g] = z
            index = col_group[:, j][:, None, None].expand(b, out, 1)
            s = scale.gather(2, index)[..., 0]
            z = None if zero is None else zero.gather(2, index)[..., 0]
            q[:, :, j] = quantize_values(w1[:, :, i], s, z, args)
            dq = (q[:, :, j] - (0 if z is None else z)) * s
            err = (w1[:, :, i] - dq) / u1[:, i, i][:, None]
            # Compensate the rest of this block now; later blocks get one batched update below.
            w1[:, :, i:] -= err[:, :, None] * u1[:, i, None, i:]
            err1[:, :, i] = err
        w[:, :, b2:] -= err1 @ u[:, b1:b2, b2:]

    inv = torch.argsort(perm, dim=-1)
    q = q.gather(2, inv[:, None, :].expand(b, out, n))
    return [QuantizedTensor(store_values(q[k], args), scale[k], None if zero is None else zero[k].to(torch.int8), args)
            for k in range(b)]
