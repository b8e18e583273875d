"""The Triton kernels behind kernels.elementwise (imported only when one is launched).

Each rounds its intermediate results to the output dtype where the plain-torch code does (one
PyTorch op = one rounding), so in bf16 they give what the unfused ops give, up to the order of a sum.
"""

import triton
import triton.language as tl

from quantship.kernels._pdl_triton import start_dependent


@triton.jit
def _norm_values(x, w_ptr, n, eps, offs, mask):
    """w * round(x * rsqrt(mean(x²) + eps)) in float32 (to be rounded once to the output dtype), the
    mean in float32; x is 0 past n."""
    xf = x.to(tl.float32)
    normed = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)).to(x.dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    return normed.to(tl.float32) * w.to(tl.float32)


@triton.jit
def _norm_row(x, w_ptr, out_ptr, row, n, eps, offs, mask):
    """Store the normalized row x as output row `row`."""
    y = _norm_values(x, w_ptr, n, eps, offs, mask)
    tl.store(out_ptr + row * n + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, n, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One row per program."""
    start_dependent(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    _norm_row(tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0), w_ptr, out_ptr, row, n, eps, offs, mask)


@triton.jit
def add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, stride_x, stride_d, n, eps, BLOCK: tl.constexpr,
                        PDL: tl.constexpr):
    """A residual step and the next norm in one pass: sum = round(x + d), out = rms_norm(sum)."""
    start_dependent(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    d = tl.load(d_ptr + row * stride_d + offs, mask=mask, other=0.0)
    total = (x.to(tl.float32) + d.to(tl.float32)).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * n + offs, total, mask=mask)
    _norm_row(total, w_ptr, out_ptr, row, n, eps, offs, mask)


@triton.jit
def silu_mul_values(g, u):
    """round(round(silu(g)) * u) in g's dtype, rounded as the plain ops round; shared with the int4 GEMV
    that makes its x this way (wna16's gated x tile), so the fused and the separate product agree."""
    gf = g.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    return (silu.to(tl.float32) * u.to(tl.float32)).to(g.dtype)


@triton.jit
def silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, stride_g, stride_u, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out = round(silu(g)) * u over one row and one block of columns per program."""
    start_dependent(PDL)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + row * stride_g + offs, mask=mask, other=0.0)
    u = tl.load(u_ptr + row * stride_u + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * n + offs, silu_mul_values(g, u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _round(v, like):
    return v.to(like.dtype).to(tl.float32)


@triton.jit
def _rotated(base, cos_row, sin_row, half, offs, mask, INTERLEAVED: tl.constexpr):
    """The rotated halves (a cos - b sin, b cos + a sin) of the rope dims at `base`, in float32 holding
    values of x's dtype: each product and sum rounded as the plain ops round."""
    if INTERLEAVED:  # pairs (x0, x1), (x2, x3), ...
        a = tl.load(base + 2 * offs, mask=mask, other=0.0)
        b = tl.load(base + 2 * offs + 1, mask=mask, other=0.0)
    else:  # two halves
        a = tl.load(base + offs, mask=mask, other=0.0)
        b = tl.load(base + half + offs, mask=mask, other=0.0)
    c = _round(tl.load(cos_row + offs, mask=mask, other=0.0).to(tl.float32), a)
    s = _round(tl.load(sin_row + offs, mask=mask, other=0.0).to(tl.float32), a)
    af, bf = a.to(tl.float32), b.to(tl.float32)
    first = _round(_round(af * c, a) - _round(bf * s, a), a)
    second = _round(_round(bf * c, a) + _round(af * s, a), a)
    return first, second


@triton.jit
def rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, half, stride_a, stride_t, stride_cos, out_stride_a, out_stride_t,
                INTERLEAVED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One (leading index, position) per program; the output [A, T, 2*half] is in halves layout."""
    start_dependent(PDL)
    a_idx = tl.program_id(0)
    t = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < half
    first, second = _rotated(x_ptr + a_idx * stride_a + t * stride_t, cos_ptr + t * stride_cos,
                             sin_ptr + t * stride_cos, half, offs, mask, INTERLEAVED)
    out = out_ptr + a_idx * out_stride_a + t * out_stride_t
    tl.store(out + offs, first.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + half + offs, second.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def latent_write_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, kv_ptr, slots_ptr, stride_x, stride_cos, width, eps,
                        RANK: tl.constexpr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    """One token per program: its MLA latent row (c_kv ‖ k_rope) normalized and rotated, written into
    its cache slot: the norm, the rotary embedding, their concatenation and the cache write in one."""
    start_dependent(PDL)
    t = tl.program_id(0)
    row = x_ptr + t * stride_x
    entry = kv_ptr + tl.load(slots_ptr + t).to(tl.int64) * width
    r = tl.arange(0, BLOCK_R)
    r_ok = r < RANK
    c_kv = _norm_values(tl.load(row + r, mask=r_ok, other=0.0), w_ptr, RANK, eps, r, r_ok)
    tl.store(entry + r, c_kv.to(kv_ptr.dtype.element_ty), mask=r_ok)
    p = tl.arange(0, BLOCK_P)
    p_ok = p < HALF
    first, second = _rotated(row + RANK, cos_ptr + t * stride_cos, sin_ptr + t * stride_cos, HALF, p, p_ok,
                             INTERLEAVED)
    tl.store(entry + RANK + p, first.to(kv_ptr.dtype.element_ty), mask=p_ok)
    tl.store(entry + RANK + HALF + p, second.to(kv_ptr.dtype.element_ty), mask=p_ok)


@triton.jit
def kv_write_kernel(k_ptr, v_ptr, cos_ptr, sin_ptr, kv_ptr, slots_ptr, stride_kt, stride_kh, stride_v, stride_cos,
                    width, KV_HEADS: tl.constexpr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
                    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """One token and one K/V head per program: the head's key rotated and its values, written into the
    token's cache slot (keys of every head, then values): the key's rotary embedding, the concatenation and
    the cache write in one. A program per head, not per token: at batch 1 one program walking all heads
    took 7 µs a layer on an H100, latency bound."""
    start_dependent(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    entry = kv_ptr + tl.load(slots_ptr + t).to(tl.int64) * width
    p = tl.arange(0, BLOCK_P)
    p_ok = p < HALF
    first, second = _rotated(k_ptr + t * stride_kt + h * stride_kh, cos_ptr + t * stride_cos,
                             sin_ptr + t * stride_cos, HALF, p, p_ok, INTERLEAVED)
    tl.store(entry + h * 2 * HALF + p, first.to(kv_ptr.dtype.element_ty), mask=p_ok)
    tl.store(entry + h * 2 * HALF + HALF + p, second.to(kv_ptr.dtype.element_ty), mask=p_ok)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < 2 * HALF
    values = tl.load(v_ptr + t * stride_v + h * 2 * HALF + d, mask=d_ok, other=0.0)
    tl.store(entry + (KV_HEADS + h) * 2 * HALF + d, values.to(kv_ptr.dtype.element_ty), mask=d_ok)
