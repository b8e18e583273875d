"""llama.cpp's block layouts: packing quantship's integers into them, and quantizing floats into them.

Every function takes rows [..., n] and returns the GGUF bytes [..., n / block * block_bytes] (uint8),
which `gguf.quants.dequantize` reads back. Layouts (ggml-common.h; checked against gguf-py's
dequantizers in the tests):

- Q4_0 (32 values, 18 bytes): f16 d, then 16 bytes; byte l holds value l (low nibble) and l+16
  (high), each stored +8. y = d * (u - 8).
- Q4_1 (32, 20): f16 d, f16 m, 16 bytes as Q4_0, unsigned. y = d * u + m.
- Q8_0 (32, 34): f16 d, 32 int8. y = d * q.
- Q4_K / Q5_K (256 = 8 sub-blocks of 32): f16 d, f16 dmin, 12 bytes of 6-bit (scale, min) pairs,
  [Q5_K: 32 bytes of fifth bits], 128 bytes of nibbles. y = d * sc * u - dmin * m.
- Q6_K (256 = 16 sub-blocks of 16): 128 bytes of low nibbles, 64 bytes of high 2-bit pairs,
  16 int8 scales, f16 d. y = d * sc * (u - 32).

From quantship integers (`pack_*`) nothing is rounded except the scale's cast to f16, which is
exact for bf16 scales in f16's normal range; the export measures the difference anyway.
Floats go through gguf-py's reference quantizers for the legacy types (they are llama.cpp's own
rounding) and through `quantize_k` here for the K-quants, which gguf-py only reads.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, quants

QK_K = 256
FLOAT_TYPES = (T.F32, T.F16, T.BF16)
K_TYPES = (T.Q4_K, T.Q5_K, T.Q6_K)


def block_size(qtype: T) -> int:
    return GGML_QUANT_SIZES[qtype][0]


def _f16_bytes(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.float16).contiguous().numpy().view(np.uint8).reshape(*x.shape[:-1], -1)


def _nibbles(u: torch.Tensor) -> torch.Tensor:
    """[..., 32] values 0..15 → [..., 16] bytes: value l low, value l+16 high."""
    return (u[..., :16] | (u[..., 16:] << 4)).to(torch.uint8)


def _blocks(values: torch.Tensor, width: int) -> torch.Tensor:
    return values.reshape(*values.shape[:-1], values.shape[-1] // width, width)


def pack_q4_0(values: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
    """values int [.., n] in [-8, 7], scale [.., n/32] → Q4_0 bytes."""
    u = _blocks(values.to(torch.int16) + 8, 32)
    body = _nibbles(u).numpy()
    return np.concatenate([_f16_bytes(scale[..., None]), body], axis=-1).reshape(*values.shape[:-1], -1)


def pack_q4_1(values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> np.ndarray:
    """Asymmetric int4: y = s * (q - z) with q in [-8, 7] equals s * (q + 8) - s * (8 + z)."""
    return pack_q4_1_codes(values.to(torch.int16) + 8, scale, -(8 + zero.float()) * scale.float())


def pack_q4_1_codes(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> np.ndarray:
    """codes [.., n] in 0..15, d and m [.., n/32]: y = d * code + m."""
    u = _blocks(codes.to(torch.int16), 32)
    parts = [_f16_bytes(d[..., None]), _f16_bytes(m[..., None]), _nibbles(u).numpy()]
    return np.concatenate(parts, axis=-1).reshape(*codes.shape[:-1], -1)


def pack_q5(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None) -> np.ndarray:
    """Q5_0 (m None: y = d * (code - 16)) or Q5_1 (y = d * code + m), codes [.., n] in 0..31, d/m [.., n/32].
    Layout: f16 d, [f16 m], 4 bytes holding bit 4 of value j at bit j, then the low nibbles as Q4_0."""
    u = _blocks(codes.to(torch.int64), 32)
    high = ((u >> 4) & 1) << torch.arange(32)
    qh = high.sum(-1).to(torch.int64)
    qh_bytes = torch.stack([(qh >> (8 * k)) & 0xFF for k in range(4)], dim=-1).to(torch.uint8).numpy()
    parts = [_f16_bytes(d[..., None])] + ([] if m is None else [_f16_bytes(m[..., None])])
    parts += [qh_bytes, _nibbles(u & 0xF).numpy()]
    return np.concatenate(parts, axis=-1).reshape(*codes.shape[:-1], -1)


def pack_q8_0(values: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
    q = _blocks(values.to(torch.int8), 32).contiguous().numpy().view(np.uint8)
    return np.concatenate([_f16_bytes(scale[..., None]), q], axis=-1).reshape(*values.shape[:-1], -1)


def pack_float(w: torch.Tensor, qtype: T) -> np.ndarray:
    """F32 and F16 as their numpy dtypes, BF16 as raw bytes (what GGUFWriter takes for each)."""
    if qtype == T.F32:
        return w.float().contiguous().numpy()
    if qtype == T.F16:
        return w.to(torch.float16).contiguous().numpy()
    return w.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint8)


IMATRIX_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K)  # Q8_0 ignores it, as in llama.cpp


def quantize(w: torch.Tensor, qtype: T, importance: torch.Tensor | None = None) -> np.ndarray:
    """Round-to-nearest from floats into any supported type; with `importance` (mean squared activation
    per column, [n] or [..., n] matching w's leading dims but the rows), each block's scale and min are
    fitted to the importance-weighted error, as llama.cpp's quantizers do with an imatrix."""
    if importance is not None and qtype in IMATRIX_TYPES:
        return quantize_weighted(w.float(), qtype, importance.float())
    if qtype in FLOAT_TYPES:
        return pack_float(w, qtype)
    if qtype in K_TYPES:
        return quantize_k(w.float(), qtype)
    return quants.quantize(w.float().contiguous().numpy(), qtype)


def dequantize(data: np.ndarray, qtype: T) -> torch.Tensor:
    """GGUF bytes (or F32/F16 arrays) → float32 tensor in numpy's row-major shape."""
    if qtype == T.BF16:
        raw = np.ascontiguousarray(data).view(np.int16)
        return torch.from_numpy(raw.copy()).view(torch.bfloat16).float()
    return torch.from_numpy(np.array(quants.dequantize(data, qtype), dtype=np.float32))


def element_weights(w: torch.Tensor, importance: torch.Tensor) -> torch.Tensor:
    """ggml's weight of each value's error under an imatrix: importance[col] * sqrt(sigma² + w²), sigma² the
    row's mean square. w [..., R, n]; importance [n] or [..., n] (one row of importance per leading index)."""
    imp = importance if importance.dim() == 1 else importance.unsqueeze(-2)
    sigma2 = (w * w).mean(-1, keepdim=True)
    return imp * torch.sqrt(sigma2 + w * w)


def quantize_weighted(w: torch.Tensor, qtype: T, importance: torch.Tensor) -> np.ndarray:
    n = w.shape[-1]
    weight = element_weights(w, importance).reshape(-1, n)
    x = w.reshape(-1, n)
    rows = x.shape[0]
    if qtype in K_TYPES:
        blocks, wb = x.reshape(-1, QK_K), weight.reshape(-1, QK_K)
        params = k_quant_params(blocks, qtype, wb)
        return pack_k(k_quant_codes(blocks, params, qtype), params, qtype).reshape(*w.shape[:-1], -1)
    xb, wb = x.reshape(-1, 32), weight.reshape(-1, 32)
    if qtype in (T.Q4_0, T.Q5_0):
        half = 8 if qtype == T.Q4_0 else 16
        d = _fit_symmetric(xb, wb, half).to(torch.float16).float()
        safe = torch.where(d == 0, torch.ones_like(d), d)
        codes = torch.where(d[:, None] == 0, torch.zeros_like(xb), torch.round(xb / safe[:, None]))
        codes = codes.clamp(-half, half - 1)
        codes, d = codes.reshape(rows, n), d.reshape(rows, n // 32)
        data = pack_q4_0(codes.to(torch.int8), d) if qtype == T.Q4_0 else pack_q5(codes + 16, d)
    else:
        top = 15 if qtype == T.Q4_1 else 31
        scale, minimum = _fit_affine(xb, wb, top)
        d, m = scale.to(torch.float16).float(), (-minimum).to(torch.float16).float()
        safe = torch.where(d == 0, torch.ones_like(d), d)
        codes = torch.round((xb - m[:, None]) / safe[:, None]).clamp(0, top)
        codes, d, m = codes.reshape(rows, n), d.reshape(rows, n // 32), m.reshape(rows, n // 32)
        data = pack_q4_1_codes(codes, d, m) if qtype == T.Q4_1 else pack_q5(codes, d, m)
    return data.reshape(*w.shape[:-1], -1)


# --- K-quants: parameters chosen by a weighted search, then packed ------------------------------

def _fit_affine(x: torch.Tensor, weight: torch.Tensor, nmax: int,
                steps=(-1.0, 0.1, 20)) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and (non-negative) min per row of x [R, 32] so that x ≈ scale * u - min, u in 0..nmax.

    The idea of ggml's make_qkx2_quants: try a few grid stretches around (max - min) / nmax, and for
    each rounding solve the weighted least squares for (scale, min) in closed form; keep the best.
    """
    xmin = x.amin(-1).clamp(max=0)  # the min is subtracted, so it must not be positive
    xmax = x.amax(-1)
    span = (xmax - xmin).clamp(min=1e-30)
    best_scale = span / nmax
    best_min = -xmin
    best_err = _affine_error(x, weight, best_scale, best_min, nmax)
    start, delta, count = steps
    sw, swx = weight.sum(-1), (weight * x).sum(-1)
    for k in range(count + 1):
        iscale = (start + delta * k + nmax) / span
        u = torch.round(iscale[:, None] * (x - xmin[:, None])).clamp(0, nmax)
        swu, swu2, swxu = (weight * u).sum(-1), (weight * u * u).sum(-1), (weight * x * u).sum(-1)
        det = sw * swu2 - swu * swu
        ok = det > 0
        det = torch.where(ok, det, torch.ones_like(det))
        scale = (sw * swxu - swx * swu) / det
        low = (swu2 * swx - swu * swxu) / det  # x ≈ scale * u + low
        # A positive offset is not representable (the min is subtracted): refit the scale with offset 0.
        refit = low > 0
        scale = torch.where(refit, swxu / swu2.clamp(min=1e-30), scale)
        low = torch.where(refit, torch.zeros_like(low), low)
        err = _affine_error(x, weight, scale, -low, nmax)
        better = ok & (err < best_err) & (scale > 0)
        best_scale = torch.where(better, scale, best_scale)
        best_min = torch.where(better, -low, best_min)
        best_err = torch.where(better, err, best_err)
    return best_scale, best_min


def _affine_error(x, weight, scale, minimum, nmax) -> torch.Tensor:
    u = torch.round((x + minimum[:, None]) / scale.clamp(min=1e-30)[:, None]).clamp(0, nmax)
    return (weight * (scale[:, None] * u - minimum[:, None] - x) ** 2).sum(-1)


def _superblock(values: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sub-block values [B, S] ≥ 0 → (f16-rounded super scale [B], integer codes [B, S] in 0..levels)."""
    top = values.amax(-1)
    d = (top / levels).to(torch.float16).float()
    codes = torch.where(d[:, None] > 0, torch.round(values / d.clamp(min=1e-30)[:, None]), torch.zeros_like(values))
    return d, codes.clamp(0, levels)


def k_quant_params(x: torch.Tensor, qtype: T, weight: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Rounding grid of a K-quant for rows x [..., n]: what GPTQ needs to round onto it. `weight` (same
    shape, from element_weights) replaces ggml's default error weights when there is an imatrix."""
    blocks = x.reshape(-1, QK_K)
    n = blocks.shape[0]
    if qtype == T.Q6_K:
        sub = blocks.reshape(n, 16, 16)
        # ggml weights Q6_K's fit by x² without an importance matrix
        weight = sub * sub if weight is None else weight.reshape(n, 16, 16)
        scale = _fit_symmetric(sub.reshape(-1, 16), weight.reshape(-1, 16), 32).reshape(n, 16)
        # Scales are int8 relative to d; the largest magnitude maps to -128 like ggml does.
        big = scale.abs().amax(-1)
        pick = torch.gather(scale, 1, scale.abs().argmax(-1, keepdim=True))[:, 0]
        d = torch.where(big > 0, pick / -128.0, torch.zeros_like(big)).to(torch.float16).float()
        sc = torch.where(d[:, None] != 0, torch.round(scale / torch.where(d == 0, 1.0, d)[:, None]),
                         torch.zeros_like(scale)).clamp(-128, 127)
        return {"d": d, "sc": sc}
    nmax = 15 if qtype == T.Q4_K else 31
    sub = blocks.reshape(n * 8, 32)
    if weight is None:
        weight = (sub * sub).mean(-1, keepdim=True).sqrt() + sub.abs()  # ggml's weights: rms + |x|
    scale, minimum = _fit_affine(sub, weight.reshape(n * 8, 32), nmax)
    d, sc = _superblock(scale.reshape(n, 8), 63)
    dmin, mn = _superblock(minimum.reshape(n, 8), 63)
    return {"d": d, "sc": sc, "dmin": dmin, "mn": mn}


def _fit_symmetric(x: torch.Tensor, weight: torch.Tensor, nmax: int) -> torch.Tensor:
    """Signed scale per row with codes in [-nmax, nmax - 1]: stretch the largest magnitude onto -nmax
    (the side with one more level) and search a few stretches by weighted error."""
    pick = torch.gather(x, 1, x.abs().argmax(-1, keepdim=True))[:, 0]
    safe = torch.where(pick == 0, torch.ones_like(pick), pick)
    best_scale = pick / -nmax
    best_err = torch.full_like(pick, float("inf"))
    for k in range(-9, 10):
        iscale = -(nmax + 0.1 * k) / safe
        u = torch.round(iscale[:, None] * x).clamp(-nmax, nmax - 1)
        swxu, swu2 = (weight * x * u).sum(-1), (weight * u * u).sum(-1)
        scale = swxu / swu2.clamp(min=1e-30)
        err = (weight * (scale[:, None] * u - x) ** 2).sum(-1)
        better = err < best_err
        best_scale = torch.where(better, scale, best_scale)
        best_err = torch.where(better, err, best_err)
    return torch.where(pick == 0, torch.zeros_like(pick), best_scale)


def k_quant_codes(x: torch.Tensor, params: dict[str, torch.Tensor], qtype: T) -> torch.Tensor:
    """Round rows x [N, 256] (N super-blocks) onto the grid `params` describes → unsigned codes."""
    n = x.shape[0]
    if qtype == T.Q6_K:
        step = (params["d"][:, None] * params["sc"]).repeat_interleave(16, dim=1)
        safe = torch.where(step == 0, torch.ones_like(step), step)
        return torch.where(step == 0, torch.zeros_like(x), torch.round(x / safe)).clamp(-32, 31) + 32
    nmax = 15 if qtype == T.Q4_K else 31
    step = (params["d"][:, None] * params["sc"]).repeat_interleave(32, dim=1)
    low = (params["dmin"][:, None] * params["mn"]).repeat_interleave(32, dim=1)
    safe = torch.where(step == 0, torch.ones_like(step), step)
    return torch.where(step == 0, torch.zeros_like(x), torch.round((x + low) / safe)).clamp(0, nmax).reshape(n, QK_K)


def k_quant_values(codes: torch.Tensor, params: dict[str, torch.Tensor], qtype: T) -> torch.Tensor:
    """Dequantized values [N, 256] of codes on a grid (what llama.cpp will compute)."""
    if qtype == T.Q6_K:
        step = (params["d"][:, None] * params["sc"]).repeat_interleave(16, dim=1)
        return step * (codes - 32)
    step = (params["d"][:, None] * params["sc"]).repeat_interleave(32, dim=1)
    low = (params["dmin"][:, None] * params["mn"]).repeat_interleave(32, dim=1)
    return step * codes - low


def quantize_k(w: torch.Tensor, qtype: T) -> np.ndarray:
    blocks = w.reshape(-1, QK_K)
    params = k_quant_params(blocks, qtype)
    return pack_k(k_quant_codes(blocks, params, qtype), params, qtype).reshape(*w.shape[:-1], -1)


def pack_k(codes: torch.Tensor, params: dict[str, torch.Tensor], qtype: T) -> np.ndarray:
    """Unsigned codes [N, 256] and their grid → K-quant bytes [N, block_bytes]."""
    u = codes.to(torch.int32)
    n = u.shape[0]
    if qtype == T.Q6_K:
        halves = u.reshape(n, 2, 2, 2, 32)  # (half h, nibble k, row r, lane l): element 128h + 64k + 32r + l
        low, high = halves & 0xF, halves >> 4
        ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
        shifts = torch.tensor([0, 2, 4, 6]).reshape(1, 1, 4, 1)
        qh = (high.reshape(n, 2, 4, 32) << shifts).sum(2).reshape(n, 64)
        sc = params["sc"].to(torch.int8).contiguous().numpy().view(np.uint8)
        return np.concatenate([ql.to(torch.uint8).numpy(), qh.to(torch.uint8).numpy(), sc,
                               _f16_bytes(params["d"][:, None])], axis=-1)
    sc, mn = params["sc"].to(torch.int32), params["mn"].to(torch.int32)
    scales = torch.cat([
        sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
        mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4),
    ], dim=1).to(torch.uint8).numpy()
    pairs = (u & 0xF).reshape(n, 4, 2, 32)  # chunk c of 64: sub-block 2c low nibbles, 2c+1 high
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, 128).to(torch.uint8).numpy()
    head = [_f16_bytes(params["d"][:, None]), _f16_bytes(params["dmin"][:, None]), scales]
    if qtype == T.Q5_K:
        bits = (u >> 4).reshape(n, 8, 32) << torch.arange(8).reshape(1, 8, 1)
        head.append(bits.sum(1).to(torch.uint8).numpy())
    return np.concatenate(head + [qs], axis=-1)
