"""The Triton kernels behind kernels.wna16 (imported only when one is launched; the layout is there).

The same arithmetic in the shapes wna16.BLOCKS_BY_M chooses by M (rows of x):
- wna16_gemv_kernel (decode, M of a few rows): no tensor cores. Each program takes a word tile
  [R, BN] (a few K steps: many programs, partial sums added atomically, as GemLite's reverse split-K)
  and accumulates value i of every word against x's column r*P + i (x's K tile loaded once and sliced
  per value position, _x_tile), in registers, no reshape of the weights. The integer to float
  conversion is the exponent trick (q | 0x4B000000 is the float 2^23 + q) on the value masked in
  place, with the offset folded into the subtraction (_word_values).
- wna16_gemv_bf16x2_kernel: the int4 GEMV with bf16 x, two values per instruction through inline
  bf16x2 PTX (GPU only); the table's choice for one row (14% faster than the float32 GEMV, measured).
- wna16_swap_dot_kernel (a sweep candidate): y^T = W x^T on tensor cores, one product per value position
  of the word tile, x permuted per call so each product's x is contiguous (wna16.permute_x).
- wna16_swap_x_kernel (2 to 64 rows where swap_bf16x2 cannot take the weight: int8, groups of 16): the
  same products, x read as it is, a K tile ahead.
- wna16_swap_bf16x2_kernel (int4, 2 to 256 rows): the swap tile's operands with one product per K tile, the
  words spread in registers to a pair order and dequantized two values per bf16x2 instruction, x permuted
  to match. wna16_swap_bf16x2_tma_kernel: the same tile with x's and the words' tiles copied by TMA (tensor
  descriptors), the table's choice from 16 to 256 rows where the GPU and the tensors allow (wna16.tma_fits).
- dequantize_kernel (past the tiles' rows): writes the bf16 weight transposed [K, N] once; cuBLAS does the
  rest.
The fused MoE reuses these pieces: the GEMV's words / x / product steps for its slot GEMV,
packed_tile_dot (x's tile of rows gathered per expert as the left operand) for its decode blocks.
"""

import triton
import triton.language as tl

from quantship.kernels._elementwise_triton import silu_mul_values
from quantship.kernels._pdl_triton import release_dependents, wait_for_inputs

MAGIC = tl.constexpr(0x4B000000)  # float32 bits of 2^23: OR a small integer into the mantissa, read the float back
MAGIC_VALUE = tl.constexpr(8388608.0)


@triton.jit
def _to_float(q):
    """Small non-negative integers to float32 exactly, in two full-rate instructions (no I2F)."""
    return (q | MAGIC).to(tl.float32, bitcast=True) - MAGIC_VALUE


@triton.jit
def _tile_values(w_ptr, rows, offs_n, word_rows, N, stride_wk, stride_wn, shifts, BITS: tl.constexpr):
    """[P, R, BN] float32 unsigned values of word rows `rows` (0 where out of range). The word axis
    P leads, so each thread keeps a word's values in its registers."""
    mask = (rows[:, None] < word_rows) & (offs_n[None, :] < N)
    words = tl.load(w_ptr + rows[:, None] * stride_wk + offs_n[None, :] * stride_wn, mask=mask, other=0)
    return _to_float((words[None, :, :] >> shifts[:, None, None]) & ((1 << BITS) - 1))


@triton.jit
def _tile_values_2d(w_ptr, offs_k, offs_n, word_rows, N, BITS: tl.constexpr):
    """[BK, BN] float32 unsigned values; each word is loaded once per value (the repeats hit L1), which
    keeps the tile 2-D for tl.dot without a reshape."""
    PER_WORD: tl.constexpr = 32 // BITS
    rows = offs_k // PER_WORD
    mask = (rows[:, None] < word_rows) & (offs_n[None, :] < N)
    words = tl.load(w_ptr + rows[:, None] * N + offs_n[None, :], mask=mask, other=0)
    return _to_float((words >> ((offs_k[:, None] % PER_WORD) * BITS)) & ((1 << BITS) - 1))


@triton.jit
def _word_row(k0, BITS: tl.constexpr, ROWS: tl.constexpr):
    """The word row of input k0, where k0 is a whole number of K tiles of ROWS word rows (every split starts at
    one: wna16.split_range), said so to the compiler: with words K-contiguous, a tile's runs of words are then
    16-byte aligned and load as vectors."""
    return tl.multiple_of(k0 // (32 // BITS), ROWS)


@triton.jit
def _tile_offset(z_ptr, group, offs_n, N, HAS_ZERO: tl.constexpr, BITS: tl.constexpr):
    """What the unsigned stored values are shifted by in this group: 2^(bits-1), plus the zero point."""
    if HAS_ZERO:
        zero = tl.load(z_ptr + group * N + offs_n, mask=offs_n < N, other=0).to(tl.float32)
        return zero + (1 << (BITS - 1))
    return tl.zeros_like(offs_n).to(tl.float32) + (1 << (BITS - 1))


@triton.jit
def _word_values(src, i: tl.constexpr, base, BITS: tl.constexpr, HAS_ZERO: tl.constexpr):
    """Value i of each word minus its offset, times 2^(bits * (i % half)): value i is masked in place (no
    shift; `src` is the word, or the word shifted down 16 bits for the upper half) and read as a float
    through the exponent trick, and its offset (2^(bits-1), plus the zero point `base` holds) is scaled
    the same way and subtracted in the same instruction. Callers divide x by the same power of two, so
    each value costs a mask-or, a subtraction and a multiply-add. All of it is exact in float32."""
    HALF: tl.constexpr = 16 // BITS
    SHIFT: tl.constexpr = BITS * (i % HALF)
    f = ((src & (((1 << BITS) - 1) << SHIFT)) | MAGIC).to(tl.float32, bitcast=True)
    if HAS_ZERO:
        return f - (base * (1 << SHIFT) + MAGIC_VALUE)
    return f - (MAGIC_VALUE + (1 << (BITS - 1)) * (1 << SHIFT))


@triton.jit
def _words(w_ptr, rows, offs_n, word_rows, N, stride_wk, stride_wn, EVEN_K: tl.constexpr = False):
    """Words [R, BN] of word rows `rows` and their upper halves (0 where out of range); word (j, n) at
    w_ptr + j * stride_wk + n * stride_wn (wna16's layout: either axis may be the contiguous one). EVEN_K:
    whole tiles, no row mask (which would keep words held along K from loading as vectors)."""
    if EVEN_K:
        ok = (offs_n < N)[None, :]
    else:
        ok = (rows[:, None] < word_rows) & (offs_n[None, :] < N)
    # Weights are read once: evict them first so x and the scales stay in L2.
    w = tl.load(w_ptr + rows[:, None] * stride_wk + offs_n[None, :] * stride_wn, mask=ok, other=0,
                eviction_policy="evict_first")
    return w, w >> 16


@triton.jit
def _group_scale(s_ptr, z_ptr, group, offs_n, N, BITS: tl.constexpr, HAS_ZERO: tl.constexpr):
    """One group's scale and offset base as [1, BN] (the tile lies inside the group)."""
    ok = offs_n < N
    scale = tl.load(s_ptr + group * N + offs_n, mask=ok, other=0.0).to(tl.float32)[None, :]
    base = scale
    if HAS_ZERO:
        base = tl.load(z_ptr + group * N + offs_n, mask=ok, other=0).to(tl.float32)[None, :] + (1 << (BITS - 1))
    return scale, base


@triton.jit
def _tile_meta(s_ptr, z_ptr, rows, k0, offs_n, word_rows, N, group_size, BITS: tl.constexpr,
               HAS_ZERO: tl.constexpr, SPANS: tl.constexpr):
    """A word tile's scales and offset bases: gathered per word row [R, BN] where the tile spans groups
    (SPANS), else the one group's rows [1, BN]."""
    if SPANS:
        ok = (rows[:, None] < word_rows) & (offs_n[None, :] < N)
        meta = (rows * (32 // BITS) // group_size)[:, None] * N + offs_n[None, :]
        scale = tl.load(s_ptr + meta, mask=ok, other=0.0).to(tl.float32)
        base = scale
        if HAS_ZERO:
            base = tl.load(z_ptr + meta, mask=ok, other=0).to(tl.float32) + (1 << (BITS - 1))
    else:
        scale, base = _group_scale(s_ptr, z_ptr, k0 // group_size, offs_n, N, BITS, HAS_ZERO)
    return scale, base


@triton.jit
def _tile_words(w_ptr, s_ptr, z_ptr, rows, k0, offs_n, word_rows, N, stride_wk, stride_wn, group_size,
                BITS: tl.constexpr, HAS_ZERO: tl.constexpr, SPANS: tl.constexpr, EVEN_K: tl.constexpr = False):
    """A word tile [R, BN] of word rows `rows`, its upper halves, scales and offset bases (_tile_meta)."""
    w, hi = _words(w_ptr, rows, offs_n, word_rows, N, stride_wk, stride_wn, EVEN_K)
    scale, base = _tile_meta(s_ptr, z_ptr, rows, k0, offs_n, word_rows, N, group_size, BITS, HAS_ZERO, SPANS)
    return w, hi, scale, base


@triton.jit
def _add_scaled(acc, part, scale, SPANS: tl.constexpr):
    """acc plus a tile's partial sums [R, BN] times their scales: per word row where the tile spans
    groups (acc [R, BN]), else the column sums times the group's scale row [1, BN] (acc [BN])."""
    if SPANS:
        acc += part * scale
    else:
        acc += tl.sum(part, axis=0) * tl.sum(scale, axis=0)  # scale is [1, BN]: the sum is the row
    return acc


@triton.jit
def _last_split(counter_ptr, splits):
    """Counts this program's split of its tile in (after its partial sums: every thread's adds are in
    before the one thread that counts releases them); true for the program that counts the last one,
    which resets the counter for the next call."""
    tl.debug_barrier()
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    last = done == splits - 1
    if last:
        tl.store(counter_ptr, 0)
    return last


@triton.jit
def _take_sums(ws_ptrs, mask):
    """The summed splits of a tile, read from L2 (where they were added), and the workspace cleared:
    threads holding the same element (a replicated layout) all read it before any clears it."""
    total = tl.load(ws_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    tl.debug_barrier()
    tl.store(ws_ptrs, tl.zeros_like(total), mask=mask)
    return total


@triton.jit
def _add_split(part, ws_ptrs, y_ptrs, mask, counter_ptr, splits):
    """One split's partial sums of a K split, finished in the kernel: added atomically into a float32
    workspace; the program that adds the last split of its tile writes y in y's dtype and zeroes the
    workspace and its counter for the next call. One launch instead of a memset, the kernel and a cast."""
    tl.atomic_add(ws_ptrs, part, mask=mask, sem="relaxed")
    _finish_split(ws_ptrs, y_ptrs, mask, counter_ptr, splits)


@triton.jit
def _finish_split(ws_ptrs, y_ptrs, mask, counter_ptr, splits):
    """A split's sums added into the workspace, counted in: the program that counts the last split of the tile
    writes y from the workspace (and clears it; _take_sums)."""
    if _last_split(counter_ptr, splits):
        tl.store(y_ptrs, _take_sums(ws_ptrs, mask).to(y_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _store_tile(acc, y_ptr, ws_ptr, counter_ptr, offsets, mask, tile, splits, ATOMIC: tl.constexpr,
                FINISH: tl.constexpr):
    """A tile of y from its accumulator: stored; or, K split, added atomically into y (float32, zeroed by
    the caller) or finished in the kernel through the workspace (FINISH)."""
    if ATOMIC:
        if FINISH:
            _add_split(acc, ws_ptr + offsets, y_ptr + offsets, mask, counter_ptr + tile, splits)
        else:
            tl.atomic_add(y_ptr + offsets, acc, mask=mask, sem="relaxed")
    else:
        tl.store(y_ptr + offsets, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quarters(t):
    """[4Q] → its elements 4q, 4q + 1, 4q + 2 and 4q + 3, [Q] each (each thread holds its four together)."""
    even, odd = tl.split(tl.reshape(t, [t.shape[0] // 4, 2, 2]))
    first, third = tl.split(even)
    second, fourth = tl.split(odd)
    return first, second, third, fourth


@triton.jit
def _add_quads(ptrs, values, mask):
    """values [BN] added into the float32s at ptrs (consecutive, the first 16-byte aligned, BN a multiple of 4, mask
    the same within each 4) by one vector reduction per 4 values (red...add.v4.f32, sm_90; GPU only), where
    tl.atomic_add makes one atomic operation per value: a quarter of the K split's atomic traffic into L2."""
    a, b, c, d = _quarters(values)
    first, _, _, _ = _quarters(ptrs)
    ok, _, _, _ = _quarters(mask.to(tl.int32))
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $6, 0; "
                              "@p red.relaxed.gpu.global.add.v4.f32 [$1], {$2, $3, $4, $5}; mov.u32 $0, 0; }",
                              "=r,l,f,f,f,f,r", [first.to(tl.int64), a, b, c, d, ok], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def _store_row(acc, y_ptr, ws_ptr, counter_ptr, row_m, N, offs_n, pid_n, splits, ATOMIC: tl.constexpr,
               FINISH: tl.constexpr, SPANS: tl.constexpr, QUADS: tl.constexpr = False):
    """Row row_m of y from a GEMV's accumulator (_store_tile; a tile is BN outputs of one row). QUADS (N a multiple
    of 4, GPU only): a K split finished in the kernel adds its sums four per operation (_add_quads)."""
    if SPANS:
        y = tl.sum(acc, axis=0)
    else:
        y = acc
    offsets, mask, tile = row_m * N + offs_n, offs_n < N, row_m * tl.num_programs(0) + pid_n
    if ATOMIC & FINISH & QUADS:
        _add_quads(ws_ptr + offsets, y, mask)
        _finish_split(ws_ptr + offsets, y_ptr + offsets, mask, counter_ptr + tile, splits)
    else:
        _store_tile(y, y_ptr, ws_ptr, counter_ptr, offsets, mask, tile, splits, ATOMIC, FINISH)


@triton.jit
def _x_tile(x_row, k0, r, K, PER_WORD: tl.constexpr, GATED: tl.constexpr):
    """The inputs k0 + r*P + i of one row of x as a tile [R, 1, P] (0 past K), for _value_slices. One load:
    as compiled, the tile is spread over the threads and broadcast through shared memory. A load per value
    position and word row gave every thread 8 times as many load instructions as weight loads (PTX for
    sm_90, int4, one K tile: 646 instructions in the bf16x2 GEMV against 363 now, 1,681 against 1,293 in
    the float32 one)."""
    k = k0 + r[:, None, None] * PER_WORD + tl.arange(0, PER_WORD)[None, None, :]
    x = tl.load(x_row + k, mask=k < K, other=0.0)
    if GATED:  # the row holds an MLP's gate and up side by side (K each): x is SwiGLU's product, made here
        x = silu_mul_values(x, tl.load(x_row + K + k, mask=k < K, other=0.0))
    return x


@triton.jit
def _halves(t):
    """[R, M, 2J] → the even and the odd positions of the last axis, [R, M, J] each."""
    return tl.split(tl.reshape(t, [t.shape[0], t.shape[1], t.shape[2] // 2, 2]))


@triton.jit
def _value_slices(xs, PER_WORD: tl.constexpr):
    """x's tile [R, BM, P] (x[m, k0 + r*P + i] at [r, m, i]) as P tensors [R, BM], the i-th the inputs that
    value i of each word row multiplies. The tile is one load of x as it is; the slices are
    register selections where each thread holds its inputs' P values (the compiled kernel rearranges the
    small x tile once per K tile before the first split, the weights not at all). BM is 1 in the GEMVs."""
    even, odd = _halves(xs)
    if PER_WORD == 8:
        e0, e1 = _halves(even)  # values 0, 4 and 2, 6
        o0, o1 = _halves(odd)  # values 1, 5 and 3, 7
        x0, x4 = tl.split(e0)
        x2, x6 = tl.split(e1)
        x1, x5 = tl.split(o0)
        x3, x7 = tl.split(o1)
        slices = (x0, x1, x2, x3, x4, x5, x6, x7)
    else:
        x0, x2 = tl.split(even)
        x1, x3 = tl.split(odd)
        slices = (x0, x1, x2, x3)
    return slices


@triton.jit
def _bf16_bits(x):
    """bf16 values' 16 bits in the low half of an int32."""
    return x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _x_pairs(x_row, k0, r, K, GATED: tl.constexpr):
    """x's inputs k0 + 8r + i (low half) and + i + 4 (high half) as bf16x2 words [R, 1], i = 0..3: the
    tile in one load, sliced in registers (_value_slices). Its bits are taken before the slicing, so the
    compiled kernel pairs them where they were loaded and spreads 4 words a row rather than 8 values
    (363 PTX instructions a K tile, against 453 pairing after)."""
    x0, x1, x2, x3, x4, x5, x6, x7 = _value_slices(_bf16_bits(_x_tile(x_row, k0, r, K, 8, GATED)), 8)
    return x0 | (x4 << 16), x1 | (x5 << 16), x2 | (x6 << 16), x3 | (x7 << 16)


# One int4 word (8 values) times 8 bf16 inputs, two values per instruction: each pair of nibbles i and i + 4
# is OR-ed into the mantissas of a bf16x2 128.0 (lop3), offset by -(128 + 8 + zero) (exact in bf16),
# multiplied by x's pair and chained through 4 bf16x2 FMAs; the two halves are added in float32.
# $0: float32 result; $1: word; $2-$5: x pairs (i, i + 4) for i = 0..3; $6: -(136 + zero) as bf16x2.
_DOT8_BF16X2 = tl.constexpr("""{
.reg .b32 t0, t1, t2, t3, s, m, c, one, nz, a;
.reg .f32 lo, hi;
mov.b32 m, 0x000F000F;
mov.b32 c, 0x43004300;
mov.b32 one, 0x3F803F80;
mov.b32 nz, 0x80008000;
lop3.b32 t0, $1, m, c, 0xea;
shr.u32 s, $1, 4;
lop3.b32 t1, s, m, c, 0xea;
shr.u32 s, $1, 8;
lop3.b32 t2, s, m, c, 0xea;
shr.u32 s, $1, 12;
lop3.b32 t3, s, m, c, 0xea;
fma.rn.bf16x2 t0, t0, one, $6;
fma.rn.bf16x2 t1, t1, one, $6;
fma.rn.bf16x2 t2, t2, one, $6;
fma.rn.bf16x2 t3, t3, one, $6;
fma.rn.bf16x2 a, t0, $2, nz;
fma.rn.bf16x2 a, t1, $3, a;
fma.rn.bf16x2 a, t2, $4, a;
fma.rn.bf16x2 a, t3, $5, a;
shl.b32 s, a, 16;
mov.b32 lo, s;
and.b32 s, a, 0xFFFF0000;
mov.b32 hi, s;
add.f32 $0, lo, hi;
}""")


@triton.jit
def gemv_x(x_row, k0, r, K, BITS: tl.constexpr, BF16X2: tl.constexpr, GATED: tl.constexpr):
    """One K tile of x (inputs k0 .. k0 + R*P of the row `x_row` points at) as the GEMV's product takes it:
    bf16x2 pairs (BF16X2, _x_pairs), or float32 slices per value position over 2^(bits * (i % half))
    (_word_values' scaling), scaled on the tile as loaded, before it is sliced and spread."""
    PER_WORD: tl.constexpr = 32 // BITS
    if BF16X2:
        xs = _x_pairs(x_row, k0, r, K, GATED)
    else:
        position = tl.arange(0, PER_WORD)
        divisor = (1 << (BITS * (position % (PER_WORD // 2)))).to(tl.float32)
        xs = _value_slices(_x_tile(x_row, k0, r, K, PER_WORD, GATED).to(tl.float32) / divisor[None, None, :],
                           PER_WORD)
    return xs


@triton.jit
def gemv_product(acc, words, xs, BITS: tl.constexpr, HAS_ZERO: tl.constexpr, SPANS: tl.constexpr,
                 BF16X2: tl.constexpr):
    """acc plus one K tile of the GEMV: the word tile (_tile_words: words [R, BN], upper halves, scales,
    offset bases) times x's tile (gemv_x), on CUDA cores. BF16X2 (int4, bf16 x, GPU only): two values per
    instruction (_DOT8_BF16X2), products and 4-term chains rounded to bf16 as a bf16 dequantized weight
    would be; else float32 throughout."""
    w, hi, scale, base = words
    if BF16X2:
        if HAS_ZERO:
            offset = base + 128.0  # base is the zero point + 8
        else:
            offset = tl.zeros_like(scale) + 136.0
        neg = (-offset).to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        part = tl.inline_asm_elementwise(_DOT8_BF16X2, "=r,r,r,r,r,r,r",
                                         [w, xs[0], xs[1], xs[2], xs[3], neg | (neg << 16)],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        PER_WORD: tl.constexpr = 32 // BITS
        part = tl.zeros(w.shape, dtype=tl.float32)
        for i in tl.static_range(PER_WORD):
            part += _word_values(w if i < PER_WORD // 2 else hi, i, base, BITS, HAS_ZERO) * xs[i]
    return _add_scaled(acc, part, scale, SPANS)


@triton.jit
def gemv_tile(acc, x_row, w_ptr, s_ptr, z_ptr, k0, offs_n, r, word_rows, N, K, stride_wk, stride_wn, group_size,
              BITS: tl.constexpr, HAS_ZERO: tl.constexpr, SPANS: tl.constexpr, BF16X2: tl.constexpr,
              GATED: tl.constexpr, EVEN_K: tl.constexpr = False):
    """acc plus one K tile of the GEMV: inputs k0 .. k0 + R*P of the row `x_row` points at, times the word
    rows k0 / P + r of the packed weight at w_ptr (outputs offs_n). The words are loaded first, so they are
    in flight while x's tile is spread. Shared by the dense GEMVs and the fused MoE's per-slot GEMV (there
    w_ptr is one expert's weight)."""
    words = _tile_words(w_ptr, s_ptr, z_ptr, _word_row(k0, BITS, r.shape[0]) + r, k0, offs_n, word_rows, N,
                        stride_wk, stride_wn, group_size, BITS, HAS_ZERO, SPANS, EVEN_K)
    return gemv_product(acc, words, gemv_x(x_row, k0, r, K, BITS, BF16X2, GATED), BITS, HAS_ZERO, SPANS, BF16X2)


@triton.jit
def gemv_acc(ROWS: tl.constexpr, BLOCK_N: tl.constexpr, SPANS: tl.constexpr):
    """A GEMV's accumulator: [R, BN] where tiles span groups (SPANS: scaled per word row), else [BN]."""
    if SPANS:
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    return acc


@triton.jit
def _gemv(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, counter_ptr, N, K, stride_xm, stride_wk, stride_wn, group_size,
          k_per_split,
          BITS: tl.constexpr, HAS_ZERO: tl.constexpr, ATOMIC: tl.constexpr, FINISH: tl.constexpr, SPANS: tl.constexpr,
          BF16X2: tl.constexpr, GATED: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, PDL: tl.constexpr, QUADS: tl.constexpr = False):
    """The dense GEMVs' program: row program_id(1) of x, outputs program_id(0), K split program_id(2). The
    first K tile's words are loaded before waiting for the kernel before (PDL): they are weights, so with
    PDL they are in flight while that kernel finishes (the table's GEMVs have one K tile per program)."""
    PER_WORD: tl.constexpr = 32 // BITS
    ROWS: tl.constexpr = BLOCK_K // PER_WORD
    release_dependents(PDL)
    pid_n = tl.program_id(0)
    row_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, ROWS)
    word_rows = tl.cdiv(K, PER_WORD)
    k_begin = tl.program_id(2) * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)  # past k_begin: every split has a tile (wna16.split_range)
    words = _tile_words(w_ptr, s_ptr, z_ptr, _word_row(k_begin, BITS, ROWS) + r, k_begin, offs_n, word_rows, N,
                        stride_wk, stride_wn, group_size, BITS, HAS_ZERO, SPANS, EVEN_K)
    wait_for_inputs(PDL)
    x_row = x_ptr + row_m * stride_xm
    acc = gemv_product(gemv_acc(ROWS, BLOCK_N, SPANS), words, gemv_x(x_row, k_begin, r, K, BITS, BF16X2, GATED),
                       BITS, HAS_ZERO, SPANS, BF16X2)
    for k0 in range(k_begin + BLOCK_K, k_end, BLOCK_K):
        acc = gemv_tile(acc, x_row, w_ptr, s_ptr, z_ptr, k0, offs_n, r, word_rows, N, K, stride_wk, stride_wn,
                        group_size, BITS, HAS_ZERO, SPANS, BF16X2, GATED, EVEN_K)
    _store_row(acc, y_ptr, ws_ptr, counter_ptr, row_m, N, offs_n, pid_n, tl.cdiv(K, k_per_split), ATOMIC, FINISH,
               SPANS, QUADS)


@triton.jit
def wna16_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, counter_ptr, M, N, K, stride_xm, stride_wk,
                      stride_wn, group_size, k_per_split, BITS: tl.constexpr, HAS_ZERO: tl.constexpr, ATOMIC: tl.constexpr,
                      FINISH: tl.constexpr, SPANS: tl.constexpr, GATED: tl.constexpr, EVEN_K: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """SPANS: the tile spans groups, so scales are gathered per word row and multiply [R, BN] partial
    sums; else one group's scale row is loaded per tile and multiplies the tile's column sums. GATED:
    each row of x is an MLP's gate and up side by side, and the product's input is SwiGLU's (_x_tile).
    EVEN_K: K is whole tiles (no row masks)."""
    _gemv(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, counter_ptr, N, K, stride_xm, stride_wk, stride_wn, group_size,
          k_per_split, BITS, HAS_ZERO, ATOMIC, FINISH, SPANS, False, GATED, EVEN_K, BLOCK_N, BLOCK_K, PDL)


@triton.jit
def wna16_gemv_bf16x2_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, counter_ptr, M, N, K, stride_xm,
                             stride_wk, stride_wn, group_size, k_per_split, HAS_ZERO: tl.constexpr, ATOMIC: tl.constexpr,
                             FINISH: tl.constexpr, SPANS: tl.constexpr, GATED: tl.constexpr, EVEN_K: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                             QUADS: tl.constexpr = False):
    """The int4 GEMV with bf16 x, dequantizing and multiplying two values per instruction (bf16x2 PTX:
    GPU only, no interpreter). Products and 4-term chains round to bf16, as a bf16 dequantized weight
    would; the rest (pair sums, scales, the accumulation over K) is float32. GATED, EVEN_K: as the GEMV's;
    QUADS: the K split's sums added four per operation (_store_row)."""
    _gemv(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, counter_ptr, N, K, stride_xm, stride_wk, stride_wn, group_size,
          k_per_split, 4, HAS_ZERO, ATOMIC, FINISH, SPANS, True, GATED, EVEN_K, BLOCK_N, BLOCK_K, PDL, QUADS)


@triton.jit
def packed_tile_dot(xt, w_ptr, s_ptr, z_ptr, k0, offs_n, K, N, group_size, BITS: tl.constexpr,
                    HAS_ZERO: tl.constexpr, SPANS: tl.constexpr):
    """[BM, BN] float32: x's K tile as loaded ([BM, R, P]: row m's input k0 + r*P + i at [m, r, i]) times
    input rows k0 .. k0 + R*P of the packed weight, on tensor cores. The word tile is loaded once and gives
    one product per value position i (x's slice i, _value_slices, against values i of the tile's word rows,
    _exact_values, x used as it is), so it is never reshaped. SPANS: the tile spans groups and the scales
    multiply the values; else one group's scale row multiplies the product."""
    PER_WORD: tl.constexpr = 32 // BITS
    r = tl.arange(0, xt.shape[1])
    w, hi, scale, base = _tile_words(w_ptr, s_ptr, z_ptr, k0 // PER_WORD + r, k0, offs_n, tl.cdiv(K, PER_WORD), N,
                                     N, 1, group_size, BITS, HAS_ZERO, SPANS)
    part = tl.zeros((xt.shape[0], offs_n.shape[0]), dtype=tl.float32)
    return _position_products(part, w, hi, scale, base, _value_slices(xt, PER_WORD), BITS, HAS_ZERO, SPANS, False)


@triton.jit
def _position_products(part, w, hi, scale, base, slices, BITS: tl.constexpr, HAS_ZERO: tl.constexpr,
                       SPANS: tl.constexpr, WEIGHT_LEFT: tl.constexpr):
    """part plus one tensor-core product per value position i: values i of the word tile (_exact_values;
    scaled per word row where SPANS) with x's slice i, the weight the left operand (WEIGHT_LEFT: y^T = W x^T)
    or the right; where not SPANS the sum is scaled per output after."""
    PER_WORD: tl.constexpr = 32 // BITS
    for i in tl.static_range(PER_WORD):
        v = _exact_values(w if i < PER_WORD // 2 else hi, i, base, BITS, HAS_ZERO)
        if SPANS:
            v = v * scale
        v = v.to(slices[0].dtype)
        if WEIGHT_LEFT:
            part = tl.dot(v, slices[i], part, out_dtype=tl.float32)
        else:
            part = tl.dot(slices[i], v, part, out_dtype=tl.float32)
    if not SPANS:
        part = part * scale
    return part


@triton.jit
def _exact_values(src, i: tl.constexpr, base, BITS: tl.constexpr, HAS_ZERO: tl.constexpr):
    """Value i of each word minus its offset, as _word_values but not scaled by 2^shift: the multiply
    by 2^-shift and the offset's subtraction are one FMA, so x is used as it is (loaded straight into
    the tensor-core product). Exact in float32: every operand and the result are small integers or
    powers of two times them."""
    HALF: tl.constexpr = 16 // BITS
    SHIFT: tl.constexpr = BITS * (i % HALF)
    f = ((src & (((1 << BITS) - 1) << SHIFT)) | MAGIC).to(tl.float32, bitcast=True)
    INV: tl.constexpr = 1.0 / (1 << SHIFT)
    if HAS_ZERO:
        return f * INV - (MAGIC_VALUE * INV + base)
    return f * INV - (MAGIC_VALUE * INV + (1 << (BITS - 1)))


@triton.jit
def _swap_tile(w_ptr, s_ptr, z_ptr, rows, k0, offs_n, word_rows, N, stride_wk, stride_wn, group_size,
               BITS: tl.constexpr, HAS_ZERO: tl.constexpr, SPANS: tl.constexpr, EVEN_K: tl.constexpr):
    """_tile_words for the swap tile, loaded as [BN, R] (the product's left operand) and its scales and
    offset bases as [BN, R] (SPANS) or [BN, 1]. EVEN_K: whole tiles, no row mask."""
    PER_WORD: tl.constexpr = 32 // BITS
    if EVEN_K:
        ok = (offs_n < N)[:, None]
    else:
        ok = (offs_n < N)[:, None] & (rows < word_rows)[None, :]
    w = tl.load(w_ptr + rows[None, :] * stride_wk + offs_n[:, None] * stride_wn, mask=ok, other=0,
                eviction_policy="evict_first")
    if SPANS:
        meta = (rows * PER_WORD // group_size)[None, :] * N + offs_n[:, None]
        meta_ok = ok
    else:
        meta = (k0 // group_size) * N + offs_n[:, None]
        meta_ok = (offs_n < N)[:, None]
    scale = tl.load(s_ptr + meta, mask=meta_ok, other=0.0).to(tl.float32)
    base = scale
    if HAS_ZERO:
        base = tl.load(z_ptr + meta, mask=meta_ok, other=0).to(tl.float32) + (1 << (BITS - 1))
    return w, w >> 16, scale, base


@triton.jit
def _swap_program(M, K, k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                  ROWS_FIRST: tl.constexpr):
    """A swap tile program's rows of x (and their mask), outputs, word rows of a K tile, and K range. The
    grid's first axis (the one launched fastest) walks the output tiles, or the row blocks (ROWS_FIRST):
    then the programs reading one weight tile for different rows of x run together, and all but the
    first find it in L2."""
    if ROWS_FIRST:
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    else:
        pid_m, pid_n = tl.program_id(1), tl.program_id(0)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_begin = tl.program_id(2) * k_per_split
    return offs_m, offs_n, offs_m < M, tl.arange(0, ROWS), k_begin, tl.minimum(k_begin + k_per_split, K)


@triton.jit
def _prefetch_l2(ptrs, mask):
    """The 128-byte line of each address where mask holds into L2, nothing into registers (PTX prefetch;
    GPU only)."""
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                              "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_words(w_ptr, rows, offs_n, word_rows, N, stride_wk, stride_wn, wanted):
    """A tile of words (word rows `rows`, outputs offs_n) prefetched into L2 where `wanted`, a line each."""
    offsets = rows[:, None] * stride_wk + offs_n[None, :] * stride_wn
    # one address per 128-byte line (32 words), and the first of the tile's run in each line
    first = tl.where(stride_wk == 1, rows[:, None] == tl.min(rows, axis=0),
                     offs_n[None, :] == tl.min(offs_n, axis=0))
    line = (offsets % 32 == 0) | first
    _prefetch_l2(w_ptr + offsets, (rows[:, None] < word_rows) & (offs_n[None, :] < N) & line & wanted)


@triton.jit
def _start_swap(w_ptr, rows, offs_n, word_rows, N, stride_wk, stride_wn, PDL: tl.constexpr):
    """A swap tile's start under PDL (_pdl_triton): the next kernel released, the first K tile's words
    (word rows `rows`, outputs offs_n) prefetched into L2, a line each, then the wait for the kernel before.
    Prefetched rather than loaded as the GEMVs' are, so the loads stay in the loop Triton pipelines."""
    if PDL:
        release_dependents(PDL)
        _prefetch_words(w_ptr, rows, offs_n, word_rows, N, stride_wk, stride_wn, True)
        wait_for_inputs(PDL)


@triton.jit
def _start_stream(w_ptr, start, end, K, tiles_m, N, stride_wk, stride_wn, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, STEPS: tl.constexpr, PDL: tl.constexpr):
    """The stream kernel's start under PDL: as _start_swap, with the words of its run's first STEPS K tiles
    prefetched (those the run has), so that the weight traffic of more than one K tile fills the time the
    kernel before still runs: a norm or the attention of a decode step, short kernels that leave the
    bandwidth idle."""
    if PDL:
        release_dependents(PDL)
        k_steps = tl.cdiv(K, BLOCK_K)
        for s in tl.static_range(STEPS):
            tile = (start + s) // k_steps
            kk = start + s - tile * k_steps
            _prefetch_words(w_ptr, kk * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8),
                            (tile // tiles_m) * BLOCK_N + tl.arange(0, BLOCK_N), tl.cdiv(K, 8), N,
                            stride_wk, stride_wn, start + s < end)
        wait_for_inputs(PDL)


@triton.jit
def _store_swap(acc, y_ptr, ws_ptr, counter_ptr, offs_m, offs_n, m_ok, N, K, k_per_split, ATOMIC: tl.constexpr,
                FINISH: tl.constexpr):
    """y^T's tile [BN, BM] into y [M, N] (_store_tile)."""
    offsets, mask = _y_tile(offs_m, offs_n, m_ok, N)
    _store_tile(acc, y_ptr, ws_ptr, counter_ptr, offsets, mask, tl.program_id(1) * tl.num_programs(0) + tl.program_id(0),
                tl.cdiv(K, k_per_split), ATOMIC, FINISH)


@triton.jit
def _y_tile(offs_m, offs_n, m_ok, N):
    """The offsets into y [M, N] of a swap tile's outputs as it holds them ([BN, BM]: y^T), and their mask."""
    return offs_m[None, :] * N + offs_n[:, None], m_ok[None, :] & (offs_n[:, None] < N)


@triton.jit
def wna16_swap_dot_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, counter_ptr, M, N, K, stride_xm, stride_wk,
                          stride_wn, group_size, k_per_split, BITS: tl.constexpr, HAS_ZERO: tl.constexpr, ATOMIC: tl.constexpr,
                          FINISH: tl.constexpr, SPANS: tl.constexpr,
                          EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, ROWS_FIRST: tl.constexpr, PDL: tl.constexpr):
    """y^T = W x^T on tensor cores for a few to 64 rows of x. The weight is the left operand: its
    [BN, R] word tile is loaded once (pipelined into shared memory, read in the product's register
    layout) and gives one product per value position i, so BN outputs fill the instruction's wide
    side however few rows x has (Hopper's wgmma takes that operand from registers). x comes permuted
    and padded to whole tiles (wna16.permute_x): the inputs value i of 16 consecutive word rows meets
    are 16 contiguous columns, loaded as they are. SPANS: the tile spans groups, scales gathered per
    word row multiply the values. EVEN_K: K is whole tiles (no row masks)."""
    PER_WORD: tl.constexpr = 32 // BITS
    ROWS: tl.constexpr = BLOCK_K // PER_WORD
    BLOCK: tl.constexpr = 16 * PER_WORD  # inputs per permutation block of x
    offs_m, offs_n, m_ok, r, k_begin, k_end = _swap_program(M, K, k_per_split, BLOCK_M, BLOCK_N, ROWS, ROWS_FIRST)
    _start_swap(w_ptr, k_begin // PER_WORD + r, offs_n, tl.cdiv(K, PER_WORD), N, stride_wk, stride_wn, PDL)
    if ROWS == 16:
        x_cols = r
    else:
        x_cols = (r // 16) * BLOCK + r % 16
    x_rows = x_ptr + offs_m[None, :] * stride_xm
    word_rows = tl.cdiv(K, PER_WORD)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        w, hi, scale, base = _swap_tile(w_ptr, s_ptr, z_ptr, _word_row(k0, BITS, ROWS) + r, k0, offs_n, word_rows,
                                        N, stride_wk, stride_wn, group_size, BITS, HAS_ZERO, SPANS, EVEN_K)
        part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for i in tl.static_range(PER_WORD):
            x = tl.load(x_rows + (k0 + 16 * i + x_cols)[:, None], mask=m_ok[None, :], other=0.0)
            v = _exact_values(w if i < PER_WORD // 2 else hi, i, base, BITS, HAS_ZERO)
            if SPANS:
                v = v * scale
            part = tl.dot(v.to(x_ptr.dtype.element_ty), x, part, out_dtype=tl.float32)
        if SPANS:
            acc += part
        else:
            acc += part * scale
    _store_swap(acc, y_ptr, ws_ptr, counter_ptr, offs_m, offs_n, m_ok, N, K, k_per_split, ATOMIC, FINISH)


@triton.jit
def swap_tile_dot(xs, w_ptr, s_ptr, z_ptr, rows, k0, offs_n, word_rows, N, stride_wk, stride_wn, group_size,
                  BITS: tl.constexpr, HAS_ZERO: tl.constexpr, SPANS: tl.constexpr, EVEN_K: tl.constexpr):
    """[BN, BM] float32: outputs offs_n of one K tile (word rows `rows`) of y^T = W x^T, x's inputs of the
    tile given as they are ([R, BM, P], _value_slices), on tensor cores: one product per value position,
    the weight's values the left operand (_exact_values), scaled per word row (SPANS) or per output."""
    PER_WORD: tl.constexpr = 32 // BITS
    w, hi, scale, base = _swap_tile(w_ptr, s_ptr, z_ptr, rows, k0, offs_n, word_rows, N, stride_wk, stride_wn,
                                    group_size, BITS, HAS_ZERO, SPANS, EVEN_K)
    part = tl.zeros((offs_n.shape[0], xs.shape[1]), dtype=tl.float32)
    return _position_products(part, w, hi, scale, base, _value_slices(xs, PER_WORD), BITS, HAS_ZERO, SPANS, True)


@triton.jit
def wna16_swap_x_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, counter_ptr, M, N, K, stride_xm, stride_wk,
                        stride_wn, group_size, k_per_split, BITS: tl.constexpr, HAS_ZERO: tl.constexpr, ATOMIC: tl.constexpr,
                        FINISH: tl.constexpr, SPANS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS_FIRST: tl.constexpr, PDL: tl.constexpr):
    """The swap tile (wna16_swap_dot_kernel's products) reading x as it is: a K tile's inputs are one
    load [R, BM, P] (P consecutive inputs per thread, vectorized), sliced per value position in
    registers (_value_slices), and loaded a tile ahead by hand; no permuted copy of x per call, and no
    load of x between the products."""
    PER_WORD: tl.constexpr = 32 // BITS
    ROWS: tl.constexpr = BLOCK_K // PER_WORD
    offs_m, offs_n, m_ok, r, k_begin, k_end = _swap_program(M, K, k_per_split, BLOCK_M, BLOCK_N, ROWS, ROWS_FIRST)
    _start_swap(w_ptr, k_begin // PER_WORD + r, offs_n, tl.cdiv(K, PER_WORD), N, stride_wk, stride_wn, PDL)
    inputs = r[:, None, None] * PER_WORD + tl.arange(0, PER_WORD)[None, None, :]  # [R, 1, P]
    x_rows = x_ptr + offs_m[None, :, None] * stride_xm  # [1, BM, 1]
    word_rows = tl.cdiv(K, PER_WORD)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    xs = tl.load(x_rows + k_begin + inputs, mask=m_ok[None, :, None] & (k_begin + inputs < k_end), other=0.0)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k_next = k0 + BLOCK_K + inputs
        xs_next = tl.load(x_rows + k_next, mask=m_ok[None, :, None] & (k_next < k_end), other=0.0)
        acc += swap_tile_dot(xs, w_ptr, s_ptr, z_ptr, _word_row(k0, BITS, ROWS) + r, k0, offs_n, word_rows, N,
                             stride_wk, stride_wn, group_size, BITS, HAS_ZERO, SPANS, EVEN_K)
        xs = xs_next
    _store_swap(acc, y_ptr, ws_ptr, counter_ptr, offs_m, offs_n, m_ok, N, K, k_per_split, ATOMIC, FINISH)


# Two int4 values of one word as bf16x2, minus 8 (the symmetric offset): the word comes shifted so that value a
# sits at bits 0-3 and value a + 4 at bits 16-19; lop3 ORs each nibble into the mantissa of a bf16 128.0 and the
# bf16x2 subtraction of 136.0 leaves q - 8, exact. One input, one output (two bf16 in one register): Triton
# moves the conversion into the tensor-core operand's layout above a unary inline asm, so this runs on the
# registers the product reads, no shared-memory round trip. $0: the pair; $1, $2: the word, twice.
_PAIR_BF16X2 = tl.constexpr("""{
.reg .b32 t, c;
lop3.b32 t, $1, 0x000F000F, 0x43004300, 0xea;
mov.b32 c, 0x43084308;
sub.rn.bf16x2 $0, t, c;
}""")


@triton.jit
def _pair_words(w, BLOCK_K: tl.constexpr):
    """A word tile [BN, R] (R a multiple of 4) spread to [BN, BLOCK_K] in the pair order: column
    kappa = 32b + 16c + 8d + 2t + h holds word 4b + t shifted down 4(2c + d) bits, so that value a = 2c + d
    (h = 0, bits 0-3) and value a + 4 (h = 1, bits 16-19) of that word sit where _pair_values takes them. The
    columns a thread holds in a tensor-core operand are (2t, 2t + 1) of each 8: a whole word's 8 values land
    in one thread, each pair in one register, so the spreading is a register copy (joins of the shifted word
    tile, a permutation and a reshape; no data moves between threads)."""
    w3 = tl.reshape(w, [w.shape[0], w.shape[1] // 4, 4])  # [BN, b, t]
    d0 = tl.join(tl.join(w3, w3), tl.join(w3 >> 4, w3 >> 4))  # [BN, b, t, h, d]: shifted 4d
    d1 = tl.join(tl.join(w3 >> 8, w3 >> 8), tl.join(w3 >> 12, w3 >> 12))  # shifted 8 + 4d
    spread = tl.join(d0, d1)  # [BN, b, t, h, d, c]
    return tl.reshape(tl.permute(spread, (0, 1, 5, 4, 2, 3)), [w.shape[0], BLOCK_K])


@triton.jit
def _pair_values(words, dtype: tl.constexpr, ASM: tl.constexpr):
    """[BN, BK] values minus 8 in `dtype`, from the pair-ordered words (_pair_words). ASM (bf16 on a GPU):
    two values per lop3 and bf16x2 subtraction (_PAIR_BF16X2); else the same numbers by shifts and masks
    (the interpreter, fp16, fp32)."""
    if ASM:
        v = tl.inline_asm_elementwise(_PAIR_BF16X2, "=r,r,r", [words], dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        h = tl.arange(0, words.shape[1]) % 2
        v = (((words >> (16 * h)[None, :]) & 15) - 8).to(tl.float32).to(dtype)
    return v


@triton.jit
def _pair_order_x(x, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr):
    """x's tile [BK, BM] as loaded (input k0 + i at row i, i = 32b + 8t + 4h + 2c + d) reordered to
    _pair_words' columns (row kappa = 32b + 16c + 8d + 2t + h): a permutation of each 32 inputs, in
    registers, before the tile goes to shared memory for the product."""
    x6 = tl.reshape(x, [BLOCK_K // 32, 4, 2, 2, 2, BLOCK_M])  # [b, t, h, c, d, m]
    return tl.reshape(tl.permute(x6, (0, 3, 4, 1, 2, 5)), [BLOCK_K, BLOCK_M])


@triton.jit
def _add_pair_tile(acc, x, w, scale, base, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, ASM: tl.constexpr,
                   X_PAIRED: tl.constexpr, HAS_ZERO: tl.constexpr):
    """acc [BN, BM] plus one K tile of swap_bf16x2, however its tiles were loaded: the word tile w [BN, R] spread to
    the pair order and dequantized two values per instruction (_pair_words, _pair_values), times x's tile [BK, BM]
    (permuted to the same order here, unless X_PAIRED: copied to it before the call), the zero point taken off
    the tile's sum, times the group's scales [BN, 1]."""
    if X_PAIRED:  # x in the pair order already (wna16.pair_order_x): its tile goes to the product as loaded
        xo = x
    else:
        xo = _pair_order_x(x, BLOCK_K, BLOCK_M)
    part = tl.dot(_pair_values(_pair_words(w, BLOCK_K), x.dtype, ASM), xo, out_dtype=tl.float32)
    if HAS_ZERO:  # sum_k (q - 8 - z) x = sum_k (q - 8) x - z sum_k x: the values stay a unary op's output
        part -= (base - 8) * tl.sum(x.to(tl.float32), axis=0)[None, :]
    return acc + part * scale


@triton.jit
def wna16_swap_bf16x2_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, counter_ptr, M, N, K, stride_xm,
                             stride_wk, stride_wn, group_size, k_per_split, HAS_ZERO: tl.constexpr, ATOMIC: tl.constexpr,
                             FINISH: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS_FIRST: tl.constexpr,
                             ASM: tl.constexpr, PDL: tl.constexpr, X_PAIRED: tl.constexpr):
    """y^T = W x^T for int4 weights on tensor cores, the weight the left operand as in the swap tiles, with one
    product per K tile: its words spread in registers to the pair order (_pair_words), dequantized two values
    per instruction (_pair_values), against x's tile loaded as it is (vectorized, pipelined) and permuted to
    the same order (_pair_order_x). The swap tiles make a product per value position, each value in float32
    (and x's slices stored for each); as compiled for sm_90 this takes about half their instructions per K
    tile. The tile lies in one quantization group (BLOCK_K divides it, or one group spans K); a zero point
    is taken off the tile's sum (times the sum of x's inputs), as a subtraction from each value would keep
    Triton from moving the values' layout conversion above the inline asm. X_PAIRED: x comes permuted already
    (wna16.pair_order_x, K a whole number of 32-input blocks), so its tiles go from memory to the product as
    loaded; permuting each tile here takes a round trip through registers and shared memory."""
    ROWS: tl.constexpr = BLOCK_K // 8
    offs_m, offs_n, m_ok, r, k_begin, k_end = _swap_program(M, K, k_per_split, BLOCK_M, BLOCK_N, ROWS, ROWS_FIRST)
    _start_swap(w_ptr, k_begin // 8 + r, offs_n, tl.cdiv(K, 8), N, stride_wk, stride_wn, PDL)
    i = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m[None, :] * stride_xm
    word_rows = tl.cdiv(K, 8)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    groups = tl.cdiv(K, group_size)
    scale, base = _column_scale(s_ptr, z_ptr, k_begin // group_size, groups, offs_n, N, HAS_ZERO)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_rows + (k0 + i)[:, None], mask=m_ok[None, :], other=0.0)
        else:
            x = tl.load(x_rows + (k0 + i)[:, None], mask=m_ok[None, :] & (k0 + i < k_end)[:, None], other=0.0)
        w, _, _, _ = _swap_tile(w_ptr, s_ptr, z_ptr, _word_row(k0, 4, ROWS) + r, k0, offs_n, word_rows, N,
                                stride_wk, stride_wn, group_size, 4, HAS_ZERO, False, EVEN_K)  # its scales unused
        # the next tile's scales, a tile ahead: Triton pipelines only the loads that feed the product, so a scale
        # loaded in its own tile is an L2 round trip waited for in every tile (ncu, H100: the largest stall;
        # a layer's calls 1.11-1.15x faster at 16-64 rows loaded ahead, alternating on one machine; against
        # other machines' runs of the table the gain looked like 1-4%)
        scale_next, base_next = _column_scale(s_ptr, z_ptr, (k0 + BLOCK_K) // group_size, groups, offs_n, N, HAS_ZERO)
        acc = _add_pair_tile(acc, x, w, scale, base, BLOCK_K, BLOCK_M, ASM, X_PAIRED, HAS_ZERO)
        scale, base = scale_next, base_next
    _store_swap(acc, y_ptr, ws_ptr, counter_ptr, offs_m, offs_n, m_ok, N, K, k_per_split, ATOMIC, FINISH)


@triton.jit
def _column_scale(s_ptr, z_ptr, group, groups, offs_n, N, HAS_ZERO: tl.constexpr):
    """One group's int4 scales and offset bases as a column [BN, 1] (the swap tiles' outputs run down); zeros
    past the last group, so a load a tile ahead of the last needs no branch."""
    ok = offs_n < tl.where(group < groups, N, 0)
    scale = tl.load(s_ptr + group * N + offs_n, mask=ok, other=0.0).to(tl.float32)[:, None]
    base = scale
    if HAS_ZERO:
        base = tl.load(z_ptr + group * N + offs_n, mask=ok, other=0).to(tl.float32)[:, None] + 8
    return scale, base


@triton.jit
def dequantize_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, stride_wk, stride_wn, group_size,
                      BITS: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PDL: tl.constexpr):
    """out [K, N] (x's dtype) = the dequantized weight, transposed: stores run along N, coalesced. A third
    grid axis walks a stack of such weights ([E, K/P, N] packed into [E, K, N]: a layer's experts). Only
    the stores wait for the kernel before (PDL: out may be memory that kernel still reads)."""
    PER_WORD: tl.constexpr = 32 // BITS
    ROWS: tl.constexpr = BLOCK_K // PER_WORD
    release_dependents(PDL)
    stack = tl.program_id(2).to(tl.int64)
    w_ptr += stack * tl.cdiv(K, PER_WORD) * N
    s_ptr += stack * tl.cdiv(K, group_size) * N
    z_ptr += stack * tl.cdiv(K, group_size) * N
    out_ptr += stack * K * N
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    r = tl.arange(0, ROWS)
    i = tl.arange(0, PER_WORD)
    q = _tile_values(w_ptr, _word_row(k0, BITS, ROWS) + r, offs_n, tl.cdiv(K, PER_WORD), N, stride_wk, stride_wn,
                     i * BITS, BITS)  # [P, R, BN]
    group = k0 // group_size
    offset = _tile_offset(z_ptr, group, offs_n, N, HAS_ZERO, BITS)
    scale = tl.load(s_ptr + group * N + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    w = (q - offset[None, None, :]) * scale[None, None, :]
    offs_k = k0 + r[None, :, None] * PER_WORD + i[:, None, None]
    mask = (offs_k < K) & (offs_n[None, None, :] < N)
    wait_for_inputs(PDL)
    tl.store(out_ptr + offs_k * N + offs_n[None, None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def wna16_swap_bf16x2_tma_kernel(x_desc, w_desc, s_ptr, z_ptr, y_ptr, ws_ptr, counter_ptr, M, N, K, group_size,
                                 k_per_split, HAS_ZERO: tl.constexpr, ATOMIC: tl.constexpr, FINISH: tl.constexpr,
                                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                 ROWS_FIRST: tl.constexpr, ASM: tl.constexpr, X_PAIRED: tl.constexpr):
    """wna16_swap_bf16x2_kernel with x's and the words' tiles loaded by the Tensor Memory Accelerator (tensor
    descriptors made on the host, wna16.matmul): one thread issues each tile's copy, where the cp.async loads
    take every thread's address arithmetic and masks (as compiled for sm_90, about 95 of the 16-row tile's 381
    instructions per K tile; through TMA the loop is 355, the copies' waits and the words' reads from shared
    memory taking some back, and 127 registers against 167). Past K and M the copies read zeros, so no masks;
    x [M, K] and the words [K/8, N] come as they lie and are transposed in shared memory."""
    ROWS: tl.constexpr = BLOCK_K // 8
    offs_m, offs_n, m_ok, r, k_begin, k_end = _swap_program(M, K, k_per_split, BLOCK_M, BLOCK_N, ROWS, ROWS_FIRST)
    m0 = (tl.program_id(0) if ROWS_FIRST else tl.program_id(1)) * BLOCK_M
    n0 = (tl.program_id(1) if ROWS_FIRST else tl.program_id(0)) * BLOCK_N
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    groups = tl.cdiv(K, group_size)
    scale, base = _column_scale(s_ptr, z_ptr, k_begin // group_size, groups, offs_n, N, HAS_ZERO)
    for k0 in range(k_begin, k_end, BLOCK_K):
        x = tl.trans(x_desc.load([m0, k0]))  # [BK, BM]
        w = tl.trans(w_desc.load([k0 // 8, n0]))  # [BN, R]
        scale_next, base_next = _column_scale(s_ptr, z_ptr, (k0 + BLOCK_K) // group_size, groups, offs_n, N, HAS_ZERO)
        acc = _add_pair_tile(acc, x, w, scale, base, BLOCK_K, BLOCK_M, ASM, X_PAIRED, HAS_ZERO)
        scale, base = scale_next, base_next
    _store_swap(acc, y_ptr, ws_ptr, counter_ptr, offs_m, offs_n, m_ok, N, K, k_per_split, ATOMIC, FINISH)


@triton.jit
def _sharing(tile, k_steps, steps_per_program):
    """How many of the stream kernel's runs take a step of `tile` (equal runs laid over the tiles' K steps)."""
    return (tile * k_steps + k_steps - 1) // steps_per_program - tile * k_steps // steps_per_program + 1


@triton.jit
def _stream_offsets(tile, tiles_m, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Output tile `tile`'s offsets into y [M, N] and their mask (_y_tile), the tiles numbered row blocks first."""
    offs_m = (tile % tiles_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    return _y_tile(offs_m, (tile // tiles_m) * BLOCK_N + tl.arange(0, BLOCK_N), offs_m < M, N)


@triton.jit
def wna16_swap_bf16x2_stream_kernel(x_desc, w_desc, s_ptr, z_ptr, y_ptr, ws_ptr, counter_ptr, M, N, K, group_size,
                                    steps_per_program, w_ptr, stride_wk, stride_wn, HAS_ZERO: tl.constexpr,
                                    FINISH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                    BLOCK_K: tl.constexpr, ASM: tl.constexpr, X_PAIRED: tl.constexpr,
                                    PDL: tl.constexpr, PREFETCH: tl.constexpr = 1):
    """wna16_swap_bf16x2_tma_kernel over an even share of all the call's K tiles (stream-K): the K steps of every
    output tile (row blocks of x first, as ROWS_FIRST), laid end to end, go to the programs in equal runs of
    steps_per_program, one loop over the run; the grid is as many programs as the GPU holds at once, so no last
    wave runs part-empty, and the copies of a tile's first K tiles are in flight while the tile before ends,
    where a K split's program waits for its first copies every few K tiles. A tile the run takes whole is stored
    inside the loop; the tiles it shares with other runs (its first and its last at most) are added to theirs
    after it (_finish_split), as the workspace's counter needs a barrier that would keep Triton from pipelining the
    loop (as compiled for sm_90: one buffer, the copies waited for in every step). Under PDL (w_ptr and its strides,
    the words the descriptor reads) its run's first PREFETCH K tiles' words are prefetched into L2 before the wait
    (_start_stream): its programs are all resident from the start, so releasing the next kernel early takes no room
    from them."""
    k_steps = tl.cdiv(K, BLOCK_K)
    tiles_m = tl.cdiv(M, BLOCK_M)
    start = tl.program_id(0) * steps_per_program
    end = tl.minimum(start + steps_per_program, tiles_m * tl.cdiv(N, BLOCK_N) * k_steps)
    groups = tl.cdiv(K, group_size)
    # the step's position carried from step to step, where dividing its index would take two divisions a step
    first = start // k_steps
    kk = start - first * k_steps
    m_blk = first % tiles_m
    n_blk = first // tiles_m
    whole = kk == 0  # this run took the current tile from its first K step
    _start_stream(w_ptr, start, end, K, tiles_m, N, stride_wk, stride_wn, BLOCK_N, BLOCK_K, PREFETCH, PDL)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    scale, base = _column_scale(s_ptr, z_ptr, kk * BLOCK_K // group_size, groups, n_blk * BLOCK_N + tl.arange(0, BLOCK_N),
                                N, HAS_ZERO)
    for g in range(start, end):
        tile = n_blk * tiles_m + m_blk
        x = tl.trans(x_desc.load([m_blk * BLOCK_M, kk * BLOCK_K]))  # [BK, BM]
        w = tl.trans(w_desc.load([kk * (BLOCK_K // 8), n_blk * BLOCK_N]))  # [BN, R]
        kk += 1
        leaving = kk == k_steps
        kk = tl.where(leaving, 0, kk)
        m_blk += leaving.to(tl.int32)
        wrapped = m_blk == tiles_m
        m_blk = tl.where(wrapped, 0, m_blk)
        n_blk += wrapped.to(tl.int32)
        scale_next, base_next = _column_scale(s_ptr, z_ptr, kk * BLOCK_K // group_size, groups,
                                              n_blk * BLOCK_N + tl.arange(0, BLOCK_N), N, HAS_ZERO)  # a step ahead
        acc = _add_pair_tile(acc, x, w, scale, base, BLOCK_K, BLOCK_M, ASM, X_PAIRED, HAS_ZERO)
        scale, base = scale_next, base_next
        if leaving & (g < end - 1):  # a tile left before the run ends: taken whole, or the run's first
            offsets, mask = _stream_offsets(tile, tiles_m, M, N, BLOCK_M, BLOCK_N)
            if whole:
                tl.store(y_ptr + offsets, acc.to(y_ptr.dtype.element_ty), mask=mask)
            else:  # counted in after the loop (_finish_split)
                tl.atomic_add((ws_ptr if FINISH else y_ptr) + offsets, acc, mask=mask, sem="relaxed")
            whole = True
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    last = (end - 1) // k_steps
    offsets, mask = _stream_offsets(last, tiles_m, M, N, BLOCK_M, BLOCK_N)
    sharing = _sharing(last, k_steps, steps_per_program)
    if FINISH & (sharing == 1):
        tl.store(y_ptr + offsets, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        _store_tile(acc, y_ptr, ws_ptr, counter_ptr, offsets, mask, last, sharing, True, FINISH)
    if FINISH & (last != first) & (start % k_steps != 0):  # the first tile, its sums added in the loop
        offsets, mask = _stream_offsets(first, tiles_m, M, N, BLOCK_M, BLOCK_N)
        _finish_split(ws_ptr + offsets, y_ptr + offsets, mask, counter_ptr + first,
                      _sharing(first, k_steps, steps_per_program))
