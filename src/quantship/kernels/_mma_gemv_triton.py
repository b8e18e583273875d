"""The int4 GEMV on tensor cores for 1 to 8 rows of bf16 x (wna16's "gemv_mma"; GPU only: inline PTX).

Each warp issues `mma.sync.m16n8k16` with the weight as A (16 outputs by 16 inputs, dequantized in registers) and
x as B (16 inputs by 8 columns, column c taking x's row c, or row 0 again past M), so one instruction multiplies
a word of each lane, where the CUDA-core GEMV spends 4 bf16x2 FMAs and a split of halves on it. The weight stays
in wna16's layout (packed [K/8, N], words held along N): a mma's operand order is free to choose as long as A's and
B's agree, and it is chosen to match the words as they lie:

- Lane 4g + t of a warp loads 4 consecutive words of word row 8j' (j' = the K step's first + t), outputs
  4g .. 4g + 3 of its 32: one 16-byte load. Words o and o + 1 (o = 0, 2) give one unit's A rows g and g + 8;
  unit A takes outputs 4g, 4g + 1, unit B 4g + 2, 4g + 3, so a warp's two units cover 32 outputs.
- A word's nibbles i and i + 4 go into one bf16x2 register by one lop3 (as 128 + value: the exponent trick), the
  pair the A fragment wants at a lane's columns (2t, 2t + 1) or (2t + 8, 2t + 9). Nibbles (0, 4) and (1, 5) of
  words o and o + 1 make the A operand of the K step's first product; (2, 6) and (3, 7) the second. The same
  inputs of x, (x_i, x_{i+4}) paired by a prmt, are B's registers, so both products multiply matching inputs.
- The 128 + 8 (+ zero point) every value carries is taken off once per group: a third product with ones as A gives
  the sums of x, in the accumulator's layout, and the group's epilogue adds scale * (C - offset * sum) in
  float32. Products and sums are exact in the tensor core (8-bit integers times bf16, accumulated in float32).

The layout is Triton's, asked for, not declared: every operand is a [reps, warps, 8, 4, 4] tensor (rep, warp, g,
t, o) loaded from contiguous runs of 4 along o, which Triton lays out as 4 registers a thread, lane 4g + t, the
warp on its axis (tests/test_kernels_compile.py checks the compiled layout; wna16 checks the results once per
device against the plain kernels before it takes this one). Inline PTX with pack=4 then sees one thread's
4 words, pairs or sums as one block.
"""

import triton
import triton.language as tl

from quantship.kernels._elementwise_triton import silu_mul_values
from quantship.kernels._pdl_triton import release_dependents, wait_for_inputs
from quantship.kernels._wna16_triton import _last_split, _take_sums

WARPS = 4  # a program's warps (the launch's num_warps)
THREADS = tl.constexpr(32 * WARPS)

_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"

# One K step (4 word rows, 32 inputs) of a thread's two units: words $8-$11 (outputs 4g .. 4g + 3), x's pairs
# $12-$15, unit A's accumulator $16-$19 and B's $20-$23 → $0-$3 and $4-$7. m, c: the nibble mask and bf16 128.0.
_UNIT = """lop3.b32 p0, $%(lo)d, m, c, 0xea;
lop3.b32 q0, $%(hi)d, m, c, 0xea;
shr.u32 s, $%(lo)d, 4;
lop3.b32 p1, s, m, c, 0xea;
shr.u32 s, $%(hi)d, 4;
lop3.b32 q1, s, m, c, 0xea;
shr.u32 s, $%(lo)d, 8;
lop3.b32 p2, s, m, c, 0xea;
shr.u32 s, $%(hi)d, 8;
lop3.b32 q2, s, m, c, 0xea;
shr.u32 s, $%(lo)d, 12;
lop3.b32 p3, s, m, c, 0xea;
shr.u32 s, $%(hi)d, 12;
lop3.b32 q3, s, m, c, 0xea;
%(mma)s {$%(d)d,$%(d1)d,$%(d2)d,$%(d3)d}, {p0,q0,p1,q1}, {$12,$13}, {%(c)s,%(c1)s,%(c2)s,%(c3)s};
%(mma)s {$%(d)d,$%(d1)d,$%(d2)d,$%(d3)d}, {p2,q2,p3,q3}, {$14,$15}, {$%(d)d,$%(d1)d,$%(d2)d,$%(d3)d};
"""


def _unit(lo: int, d: int, c: int | None) -> str:
    """One unit's two products; c: its accumulator's first operand, None for zeros (a group's first K step)."""
    acc = ("z",) * 4 if c is None else tuple(f"${c + i}" for i in range(4))
    return _UNIT % dict(lo=lo, hi=lo + 1, d=d, d1=d + 1, d2=d + 2, d3=d + 3, c=acc[0], c1=acc[1], c2=acc[2],
                        c3=acc[3], mma=_MMA)


_K_STEP_HEAD = ("{\n.reg .b32 m, c, s, z, p0, p1, p2, p3, q0, q1, q2, q3;\nmov.b32 m, 0x000F000F;\n"
                "mov.b32 c, 0x43004300;\nmov.b32 z, 0;\n")
_K_STEP = tl.constexpr(_K_STEP_HEAD + _unit(8, 0, 16) + _unit(10, 4, 20) + "}")
_K_STEP_FIRST = tl.constexpr(_K_STEP_HEAD + _unit(8, 0, None) + _unit(10, 4, None) + "}")  # $8-$15 as _K_STEP's

# x's 8 inputs of a word row as 4 int32 (bf16 pairs (x0, x1) .. (x6, x7)) $4-$7 → (x_i, x_{i+4}), i = 0..3
_X_PAIRS = tl.constexpr("""prmt.b32 $0, $4, $6, 0x5410;
prmt.b32 $1, $4, $6, 0x7632;
prmt.b32 $2, $5, $7, 0x5410;
prmt.b32 $3, $5, $7, 0x7632;""")

# Sums of x over a K step added into $8-$11, in the accumulator's layout (ones as A) → $0-$3; _X_SUMS_FIRST from 0
_X_SUMS = tl.constexpr("{\n.reg .b32 one;\nmov.b32 one, 0x3F803F80;\n"
                       f"{_MMA} {{$0,$1,$2,$3}}, {{one,one,one,one}}, {{$4,$5}}, {{$8,$9,$10,$11}};\n"
                       f"{_MMA} {{$0,$1,$2,$3}}, {{one,one,one,one}}, {{$6,$7}}, {{$0,$1,$2,$3}};\n}}")
_X_SUMS_FIRST = tl.constexpr("{\n.reg .b32 one, z;\nmov.b32 one, 0x3F803F80;\nmov.b32 z, 0;\n"
                             f"{_MMA} {{$0,$1,$2,$3}}, {{one,one,one,one}}, {{$4,$5}}, {{z,z,z,z}};\n"
                             f"{_MMA} {{$0,$1,$2,$3}}, {{one,one,one,one}}, {{$6,$7}}, {{$0,$1,$2,$3}};\n}}")

# A group's end for one unit: acc + scale * (C + neg_offset * sums), the scales $4-$7 and negated offsets $8-$11
# of outputs 4g .. 4g + 3 (the unit's rows g and g + 8 are two of them), C $12-$15, sums $16-$19, acc $20-$23.
_EPILOGUE = """{
.reg .f32 t;
fma.rn.f32 t, $%(o0)d, $16, $12;
fma.rn.f32 $0, $%(s0)d, t, $20;
fma.rn.f32 t, $%(o0)d, $17, $13;
fma.rn.f32 $1, $%(s0)d, t, $21;
fma.rn.f32 t, $%(o1)d, $18, $14;
fma.rn.f32 $2, $%(s1)d, t, $22;
fma.rn.f32 t, $%(o1)d, $19, $15;
fma.rn.f32 $3, $%(s1)d, t, $23;
}"""
_EPILOGUE_A = tl.constexpr(_EPILOGUE % dict(s0=4, s1=5, o0=8, o1=9))
_EPILOGUE_B = tl.constexpr(_EPILOGUE % dict(s0=6, s1=7, o0=10, o1=11))

# The accumulators regathered so that element o is output 4g + o: for x's row 2t ($0-$3) and 2t + 1 ($4-$7), from
# unit A's $8-$11 (rows g, g + 8 at columns 2t, 2t + 1) and B's $12-$15
_REGATHER = tl.constexpr("""mov.b32 $0, $8;
mov.b32 $1, $10;
mov.b32 $2, $12;
mov.b32 $3, $14;
mov.b32 $4, $9;
mov.b32 $5, $11;
mov.b32 $6, $13;
mov.b32 $7, $15;""")


@triton.jit
def _asm(asm: tl.constexpr, args, OUTPUTS: tl.constexpr = 1, INT: tl.constexpr = False):
    """Inline PTX over one thread's 4 elements of each operand (pack=4, every operand 32 bits): OUTPUTS float32
    tensors (a tuple of two for 2), or one int32 (INT)."""
    constraints: tl.constexpr = "=r," * (4 * OUTPUTS) + "r," * (4 * len(args) - 1) + "r"
    if INT:
        out = tl.inline_asm_elementwise(asm, constraints, args, dtype=tl.int32, is_pure=True, pack=4)
    elif OUTPUTS == 2:
        out = tl.inline_asm_elementwise(asm, constraints, args, dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
    else:
        out = tl.inline_asm_elementwise(asm, constraints, args, dtype=tl.float32, is_pure=True, pack=4)
    return out


@triton.jit
def _threads(v):
    """[reps * threads, 4] → [reps, threads, 4]: element (r, i, o) is thread i's (lane i % 32) element o of rep r.
    Operands are loaded 2-D, [reps * threads, 4] from runs of 4 along the last axis, which every Triton lays out
    the same way (4 registers a thread, threads and then warps along the first axis); a higher-rank load's axes
    are ordered differently by different Triton versions where they tie."""
    return tl.reshape(v, [v.shape[0] // THREADS, THREADS, 4])


@triton.jit
def _words(w_rows, step, lanes, t, ok, stride_wk, rows_left, EVEN_K: tl.constexpr):
    """K step `step`'s words: word row 4 step + t from w_rows (the group's first word row) at offsets `lanes`
    (t * stride_wk + n), 16 bytes a thread. The row offset is a scalar, added to one pointer per group."""
    if not EVEN_K:
        ok = ok & (4 * step + t < rows_left)
    return _threads(tl.load(w_rows + 4 * step * stride_wk + lanes, mask=ok, other=0, eviction_policy="evict_first"))


@triton.jit
def _x_pairs(x_row, word_row, o, K, GATED: tl.constexpr, EVEN_K: tl.constexpr):
    """x's inputs 8 word_row + o and + o + 4 as a bf16x2 word (o = 0..3): the B registers of a K step."""
    if GATED:  # x's row is an MLP's gate and up side by side: SwiGLU's product, as the plain GEMV makes it
        k = word_row * 8 + o
        ok = k < K
        lo = silu_mul_values(tl.load(x_row + k, mask=ok, other=0.0), tl.load(x_row + K + k, mask=ok, other=0.0))
        hi = silu_mul_values(tl.load(x_row + k + 4, mask=ok, other=0.0),
                             tl.load(x_row + K + k + 4, mask=ok, other=0.0))
        lo = lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        return _threads(lo | (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16))
    x32 = x_row.to(tl.pointer_type(tl.int32), bitcast=True)
    if EVEN_K:
        xw = tl.load(x32 + word_row * 4 + o)
    else:
        xw = tl.load(x32 + word_row * 4 + o, mask=word_row * 8 < K, other=0)
    xw = _threads(xw)
    return _asm(_X_PAIRS, [xw], INT=True)


@triton.jit
def _group(acc_a, acc_b, x_row, w_ptr, s_ptr, z_ptr, n, ok, o, t, x_t, k0, N, K, stride_wk, group_size,
           HAS_ZERO: tl.constexpr, GATED: tl.constexpr, EVEN_K: tl.constexpr, STEPS: tl.constexpr,
           WAIT: tl.constexpr):
    """acc plus STEPS K steps from input k0 (one quantization group or part of one). The group's words load
    first; WAIT: then wait for the kernel before (PDL), x being its output."""
    w_rows = w_ptr + (k0 // 8) * stride_wk
    lanes = t * stride_wk + n
    rows_left = tl.cdiv(K, 8) - k0 // 8
    w0 = _words(w_rows, 0, lanes, t, ok, stride_wk, rows_left, EVEN_K)
    w1 = w0
    w2 = w0
    w3 = w0
    if STEPS > 1:
        w1 = _words(w_rows, 1, lanes, t, ok, stride_wk, rows_left, EVEN_K)
    if STEPS > 2:
        w2 = _words(w_rows, 2, lanes, t, ok, stride_wk, rows_left, EVEN_K)
    if STEPS > 3:
        w3 = _words(w_rows, 3, lanes, t, ok, stride_wk, rows_left, EVEN_K)
    group = k0 // group_size
    scale = _threads(tl.load(s_ptr + group * N + n, mask=ok, other=0.0).to(tl.float32))
    if HAS_ZERO:
        neg = _threads(-(tl.load(z_ptr + group * N + n, mask=ok, other=0).to(tl.float32) + 136.0))
    else:
        neg = tl.full(scale.shape, -136.0, tl.float32)
    wait_for_inputs(WAIT)
    for s in tl.static_range(STEPS):
        words = w0 if s == 0 else w1 if s == 1 else w2 if s == 2 else w3
        pairs = _x_pairs(x_row, k0 // 8 + x_t + 4 * s, o, K, GATED, EVEN_K)
        if s == 0:  # a group's first products start from zero (no accumulator operands)
            sums = _asm(_X_SUMS_FIRST, [pairs])  # x's, shared by every rep of the thread
            c_a, c_b = _asm(_K_STEP_FIRST, [words, pairs], 2)
        else:
            sums = _asm(_X_SUMS, [pairs, sums])
            c_a, c_b = _asm(_K_STEP, [words, pairs, c_a, c_b], 2)
    acc_a = _asm(_EPILOGUE_A, [scale, neg, c_a, sums, acc_a])
    acc_b = _asm(_EPILOGUE_B, [scale, neg, c_b, sums, acc_b])
    return acc_a, acc_b


@triton.jit
def wna16_mma_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, counter_ptr, M, N, K, stride_xm, stride_wk,
                          group_size, k_per_split, HAS_ZERO: tl.constexpr, ATOMIC: tl.constexpr,
                          FINISH: tl.constexpr, GATED: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                          REPS: tl.constexpr, GROUP_STEPS: tl.constexpr, STEPS: tl.constexpr, PDL: tl.constexpr):
    """y[:M] = x[:M] W^T for M <= 8 rows of bf16 x and int4 W (wna16's layout, words along N): a program takes
    32 * REPS outputs (a multiple of WARPS) and STEPS K steps of 32 inputs from program_id(1) * k_per_split,
    GROUP_STEPS to a quantization group (or 4, one scale for all of K). ATOMIC: the K split's sums are added into
    ws (float32), and with FINISH the program adding the tile's last split writes y; else stored in y. EVEN_K,
    EVEN_N: K and N whole tiles (no masks). GATED: x's rows are gate and up side by side, the input SwiGLU's
    product."""
    release_dependents(PDL)
    pid_n = tl.program_id(0)
    k_begin = tl.program_id(1) * k_per_split
    i = tl.arange(0, REPS * 32)[:, None]  # rep i // THREADS, thread i % THREADS
    o = tl.arange(0, 4)[None, :]
    lane = i % 32
    g = lane // 4
    t = lane % 4
    n = pid_n * (32 * REPS) + (i // 32) * 32 + 4 * g + o  # the 32 outputs of warp-rep i // 32
    if EVEN_N:  # whole tiles of outputs: no masks, so no registers zeroed for masked loads and no compares
        ok = tl.full(n.shape, True, tl.int1)
    else:
        ok = n < N
    x_i = tl.arange(0, THREADS)[:, None] % 32  # x's operands are one rep's, shared by every rep of the thread
    x_row = x_ptr + tl.minimum(x_i // 4, M - 1) * stride_xm  # B's column g is x's row g (row 0 past M)
    x_t = x_i % 4
    acc_a = tl.zeros([REPS * 32 // THREADS, THREADS, 4], dtype=tl.float32)
    acc_b = tl.zeros([REPS * 32 // THREADS, THREADS, 4], dtype=tl.float32)
    for step in tl.static_range(0, STEPS, GROUP_STEPS):
        acc_a, acc_b = _group(acc_a, acc_b, x_row, w_ptr, s_ptr, z_ptr, n, ok, o, t, x_t, k_begin + 32 * step, N, K,
                              stride_wk, group_size, HAS_ZERO, GATED, EVEN_K, GROUP_STEPS, PDL and step == 0)
    even, odd = _asm(_REGATHER, [acc_a, acc_b], 2)
    even = tl.reshape(even, n.shape)
    odd = tl.reshape(odd, n.shape)
    row = 2 * t  # element o of `even` is output n of x's row 2t, of `odd` of row 2t + 1
    ok_even = ok & (row < M)
    ok_odd = ok & (row + 1 < M)
    if ATOMIC:
        tl.atomic_add(ws_ptr + row * N + n, even, mask=ok_even, sem="relaxed")
        tl.atomic_add(ws_ptr + (row + 1) * N + n, odd, mask=ok_odd, sem="relaxed")
        if FINISH:
            if _last_split(counter_ptr + pid_n, tl.num_programs(1)):
                tl.store(y_ptr + row * N + n, _take_sums(ws_ptr + row * N + n, ok_even).to(y_ptr.dtype.element_ty),
                         mask=ok_even)
                tl.store(y_ptr + (row + 1) * N + n,
                         _take_sums(ws_ptr + (row + 1) * N + n, ok_odd).to(y_ptr.dtype.element_ty), mask=ok_odd)
    else:
        tl.store(y_ptr + row * N + n, even.to(y_ptr.dtype.element_ty), mask=ok_even)
        tl.store(y_ptr + (row + 1) * N + n, odd.to(y_ptr.dtype.element_ty), mask=ok_odd)
