"""The int4 GEMV on tensor cores for 1 to 16 rows of bf16 x (wna16's "gemv_mma"; GPU only: inline PTX).

Each warp issues `mma.sync.m16n8k16` with the weight as A (16 outputs by 16 inputs, dequantized in registers) and
x as B (16 inputs by 8 columns, column c taking x's row c, or its last row again past M; a second block of 8 columns for
rows 8-15), so one instruction multiplies a word of each lane, where the CUDA-core GEMV spends 4 bf16x2 FMAs and a
split of halves on it. The weight stays in wna16's layout (packed [K/8, N], words held along N): a product's
operand order is free to choose as long as A's and B's agree, and it is chosen to match the words as they lie:

- Lane 4g + t of a warp loads 4 consecutive words of word row j (inputs 8j .. 8j + 7, j = the K step's first
  word row + t), outputs 4g .. 4g + 3 of its 32: one 16-byte load. Words o and o + 1 (o = 0, 2) give one unit's
  A rows g and g + 8; unit A takes outputs 4g, 4g + 1, unit B 4g + 2, 4g + 3, so a warp's two units cover 32.
- A word's nibbles i and i + 4 go into one bf16x2 register by one lop3 (as 128 + value: the exponent trick), the
  pair the A fragment wants at a lane's columns (2t, 2t + 1) or (2t + 8, 2t + 9). Nibbles (0, 4) and (1, 5) of
  words o and o + 1 make the A operand of the K step's first product; (2, 6) and (3, 7) the second. The same
  inputs of x, (x_i, x_{i+4}) paired by a prmt, are B's registers, so both products multiply matching inputs.
- The 128 + 8 (+ zero point) every value carries is taken off once per group: a product with ones as A gives
  the sums of x, in the accumulator's layout, and the group's epilogue adds scale * (C - offset * sum) in
  float32. Products and sums are exact in the tensor core (8-bit integers times bf16, accumulated in float32).

The layout is Triton's, asked for, not declared: every operand is loaded 2-D, [reps * threads, 4] from runs of 4
along the last axis, and reshaped to [reps, threads, 4], which Triton 3.6 and 3.9 both lay out as 4 registers a
thread with thread i (lane i % 32 of warp i // 32) on the middle axis. Inline PTX with pack=4 then sees one
thread's 4 words, pairs or sums as one block. tests/test_kernels_compile.py checks the compiled layout, and
wna16_mma.takes checks the first call of each compiled kind against the reference before the kernel serves it.
"""

import triton
import triton.language as tl

from quantship.kernels._elementwise_triton import silu_mul_values
from quantship.kernels._pdl_triton import release_dependents, wait_for_inputs
from quantship.kernels._wna16_triton import _last_split, _take_sums
from quantship.kernels.wna16_mma import WARPS  # a program's warps: the launch's num_warps

THREADS = tl.constexpr(32 * WARPS)

_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"

def _values(lo: int, hi: int) -> str:
    """Words $lo and $hi (a unit's rows g and g + 8) to bf16x2 registers p0-p3 and q0-q3: nibbles (i, i + 4) of
    each as 128 + value, i = 0..3, one lop3 each after a shift of 4i."""
    lines = []
    for i in range(4):
        for word, reg in ((lo, "p"), (hi, "q")):
            source = f"${word}"
            if i:
                lines.append(f"shr.u32 s, ${word}, {4 * i};")
                source = "s"
            lines.append(f"lop3.b32 {reg}{i}, {source}, m, c, 0xea;")
    return "\n".join(lines)


def _k_step(blocks: int, first: bool) -> str:
    """One K step (4 word rows, 32 inputs) of a thread's two units, for `blocks` blocks of 8 columns (x's rows 0-7,
    8-15): outputs unit A's and B's accumulators of block 1 ($0-$3, $4-$7), then of block 2; inputs the words
    (outputs 4g .. 4g + 3), x's pairs of each block, then the accumulators as output (none where `first`, a group's
    first K step: zeros). m, c: the nibble mask and bf16 128.0; each unit's values are made once for all blocks."""
    outputs = 8 * blocks
    words, pairs = outputs, outputs + 4
    accumulators = pairs + 4 * blocks
    text = ["{", ".reg .b32 m, c, s, z, p0, p1, p2, p3, q0, q1, q2, q3;", "mov.b32 m, 0x000F000F;",
            "mov.b32 c, 0x43004300;", "mov.b32 z, 0;"]
    for unit in range(2):
        text.append(_values(words + 2 * unit, words + 2 * unit + 1))
        text += _products(unit, blocks, pairs, None if first else accumulators)
    return "\n".join(text + ["}"])


def _products(unit: int, blocks: int, pairs: int, accumulators: int | None) -> list[str]:
    """A unit's two products per block of 8 columns, its values in p0-p3 and q0-q3: into its accumulators' outputs
    (unit A's and B's of block 1, then of block 2), from x's pairs (operand `pairs` on, 4 a block) and the
    accumulators as input (operand `accumulators` on, in the outputs' order; None: zeros, register z)."""
    text = []
    for block in range(blocks):
        d = 8 * block + 4 * unit
        dest = "{" + ",".join(f"${d + i}" for i in range(4)) + "}"
        acc = "{z,z,z,z}" if accumulators is None else "{" + ",".join(f"${accumulators + d + i}" for i in range(4)) + "}"
        b = pairs + 4 * block
        text.append(f"{_MMA} {dest}, {{p0,q0,p1,q1}}, {{${b},${b + 1}}}, {acc};")
        text.append(f"{_MMA} {dest}, {{p2,q2,p3,q3}}, {{${b + 2},${b + 3}}}, {dest};")
    return text


def _k_step_scaled(blocks: int, zero: bool) -> str:
    """One K step as _k_step's, its values scaled first (Blocks.scaled_values): each bf16x2 register of the A
    operand becomes (value - offset) * scale in bf16, one rounding as dequantize's, so the products add straight
    into the program's accumulators across groups (no group sums, no x sums, no epilogue). Operands: the
    accumulators as output, the words, the scale pairs (s, s) of outputs 4g .. 4g + 3, where `zero` the negated
    offset pairs (-(136 + z)) too (else -136 for every output), x's pairs of each block, the accumulators as input.
    fma with 1 and with -0.0 (exact, and one rounding) where sub and mul.bf16x2 would need sm_90."""
    outputs = 8 * blocks
    words = outputs
    scales = words + 4
    offsets = scales + 4
    pairs = offsets + 4 if zero else scales + 4
    accumulators = pairs + 4 * blocks
    text = ["{", ".reg .b32 m, c, s, one, nz, off, p0, p1, p2, p3, q0, q1, q2, q3;", "mov.b32 m, 0x000F000F;",
            "mov.b32 c, 0x43004300;", "mov.b32 one, 0x3F803F80;", "mov.b32 nz, 0x80008000;",
            "mov.b32 off, 0xC308C308;"]  # bf16 -136.0, twice: 128 + 8, the symmetric values' offset
    for unit in range(2):
        text.append(_values(words + 2 * unit, words + 2 * unit + 1))
        for reg, o in (("p", 2 * unit), ("q", 2 * unit + 1)):  # p: output 4g + 2 unit, q: the next
            offset = f"${offsets + o}" if zero else "off"
            for i in range(4):
                text.append(f"fma.rn.bf16x2 {reg}{i}, {reg}{i}, one, {offset};")
                text.append(f"fma.rn.bf16x2 {reg}{i}, {reg}{i}, ${scales + o}, nz;")
        text += _products(unit, blocks, pairs, accumulators)
    return "\n".join(text + ["}"])


_K_STEP = tl.constexpr(_k_step(1, False))
_K_STEP_FIRST = tl.constexpr(_k_step(1, True))
_K_STEP_16 = tl.constexpr(_k_step(2, False))
_K_STEP_16_FIRST = tl.constexpr(_k_step(2, True))
_K_STEP_SCALED = tl.constexpr(_k_step_scaled(1, False))
_K_STEP_SCALED_ZERO = tl.constexpr(_k_step_scaled(1, True))
_K_STEP_16_SCALED = tl.constexpr(_k_step_scaled(2, False))
_K_STEP_16_SCALED_ZERO = tl.constexpr(_k_step_scaled(2, True))

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
    tensors (a tuple for several), or one int32 (INT)."""
    constraints: tl.constexpr = "=r," * (4 * OUTPUTS) + "r," * (4 * len(args) - 1) + "r"
    if INT:
        out = tl.inline_asm_elementwise(asm, constraints, args, dtype=tl.int32, is_pure=True, pack=4)
    elif OUTPUTS == 2:
        out = tl.inline_asm_elementwise(asm, constraints, args, dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
    elif OUTPUTS == 4:
        out = tl.inline_asm_elementwise(asm, constraints, args, dtype=(tl.float32, ) * 4, is_pure=True, pack=4)
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
def _x_pairs(x_row, word_row, o, K, EVEN_K: tl.constexpr):
    """x's inputs 8 word_row + o and + o + 4 as a bf16x2 word (o = 0..3): the B registers of a K step."""
    x32 = x_row.to(tl.pointer_type(tl.int32), bitcast=True)
    if EVEN_K:
        xw = tl.load(x32 + word_row * 4 + o)
    else:
        xw = tl.load(x32 + word_row * 4 + o, mask=word_row * 8 < K, other=0)
    return _asm(_X_PAIRS, [_threads(xw)], INT=True)


@triton.jit
def _swiglu_span(x_ptr, product_ptr, k_begin, M, K, stride_xm, SPAN: tl.constexpr, COLS: tl.constexpr):
    """SiLU(gate) * up for x's rows and the program's inputs k_begin .. + SPAN, written to product_ptr ([M, K]) for
    the program's K steps to read as they read x: made once a program, each thread a few values, where making them
    per K step would repeat them for every lane that shares them (the same rounding as elementwise.silu_mul)."""
    r = tl.arange(0, COLS)[:, None]
    k = k_begin + tl.arange(0, SPAN)[None, :]
    ok = (r < M) & (k < K)
    gate = tl.load(x_ptr + r * stride_xm + k, mask=ok, other=0.0)
    up = tl.load(x_ptr + r * stride_xm + K + k, mask=ok, other=0.0)
    tl.store(product_ptr + r * K + k, silu_mul_values(gate, up), mask=ok)
    tl.debug_barrier()  # every thread's values written before any thread reads its pairs


@triton.jit
def _group_loads(w_ptr, s_ptr, z_ptr, n, ok, t, k0, N, K, stride_wk, group_size, HAS_ZERO: tl.constexpr,
                 EVEN_K: tl.constexpr, STEPS: tl.constexpr, SCALED: tl.constexpr):
    """A group's operands from memory (STEPS K steps from input k0): its words, 16 bytes a thread a step, and its
    outputs' scales and negated offsets (136, + the zero point): float32, or SCALED as bf16 pairs."""
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
    if not EVEN_K:  # a last split's groups past K have no scales: 0 (their words and x load as zeros)
        ok = ok & (k0 < K)
    scale = _threads(tl.load(s_ptr + group * N + n, mask=ok, other=0.0).to(tl.float32))
    if HAS_ZERO:
        neg = _threads(-(tl.load(z_ptr + group * N + n, mask=ok, other=0).to(tl.float32) + 136.0))
    else:
        neg = tl.full(scale.shape, -136.0, tl.float32)
    if SCALED:  # as bf16 pairs (v, v), the operands of the values' fma (the offset's only where it varies)
        scale = _bf16_pairs(scale)
        if HAS_ZERO:
            neg = _bf16_pairs(neg)
    return w0, w1, w2, w3, scale, neg


@triton.jit
def _bf16_pairs(v):
    """float32 values as int32 words holding the value rounded to bf16 twice (both halves of a bf16x2 register)."""
    bits = v.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return bits | (bits << 16)


@triton.jit
def _step_operands(w0, w1, w2, w3, s: tl.constexpr, x_rows, o, x_t, k0, K, EVEN_K: tl.constexpr,
                   COLS: tl.constexpr):
    """K step s of a group: its words (of the group's loads) and x's pairs for column block 1 and, where COLS is
    16, block 2 (else block 1's again, unused)."""
    words = w0 if s == 0 else w1 if s == 1 else w2 if s == 2 else w3
    row = k0 // 8 + x_t + 4 * s
    pairs = _x_pairs(x_rows[0], row, o, K, EVEN_K)
    pairs_2 = pairs
    if COLS == 16:
        pairs_2 = _x_pairs(x_rows[1], row, o, K, EVEN_K)
    return words, pairs, pairs_2


@triton.jit
def _group_scaled(accs, w0, w1, w2, w3, scale, neg, x_rows, o, x_t, k0, K, HAS_ZERO: tl.constexpr,
                  EVEN_K: tl.constexpr, STEPS: tl.constexpr, COLS: tl.constexpr):
    """The accumulators plus STEPS K steps of values scaled before their products (_k_step_scaled): the scale and
    offset pairs `scale`, `neg` (_bf16_pairs; `neg` unused without a zero point)."""
    for s in tl.static_range(STEPS):
        words, pairs, pairs_2 = _step_operands(w0, w1, w2, w3, s, x_rows, o, x_t, k0, K, EVEN_K, COLS)
        if COLS == 16:
            a0, a1, a2, a3 = accs
            if HAS_ZERO:
                accs = _asm(_K_STEP_16_SCALED_ZERO, [words, scale, neg, pairs, pairs_2, a0, a1, a2, a3], 4)
            else:
                accs = _asm(_K_STEP_16_SCALED, [words, scale, pairs, pairs_2, a0, a1, a2, a3], 4)
        else:
            if HAS_ZERO:
                accs = _asm(_K_STEP_SCALED_ZERO, [words, scale, neg, pairs, accs[0], accs[1]], 2)
            else:
                accs = _asm(_K_STEP_SCALED, [words, scale, pairs, accs[0], accs[1]], 2)
    return accs


@triton.jit
def _group(accs, loads, x_rows, o, x_t, k0, K, swiglu, GATED: tl.constexpr, EVEN_K: tl.constexpr,
           STEPS: tl.constexpr, FIRST: tl.constexpr, PDL: tl.constexpr, SPAN: tl.constexpr, COLS: tl.constexpr,
           SCALED: tl.constexpr, HAS_ZERO: tl.constexpr):
    """The accumulators (units A and B of column block 1, then of block 2 where COLS is 16) plus STEPS K steps
    from input k0 (one quantization group or part of one), whose operands `loads` (_group_loads) were issued
    before. In the program's FIRST group it first waits for the kernel before (PDL), x being its output, and where
    GATED makes the program's SPAN inputs of SwiGLU's product (`swiglu`: x's pointer, the product's, k_begin, M,
    stride_xm), which x_rows point into."""
    w0, w1, w2, w3, scale, neg = loads
    if FIRST:
        wait_for_inputs(PDL)
        if GATED:
            _swiglu_span(swiglu[0], swiglu[1], swiglu[2], swiglu[3], K, swiglu[4], SPAN, COLS)
    if SCALED:
        out = _group_scaled(accs, w0, w1, w2, w3, scale, neg, x_rows, o, x_t, k0, K, HAS_ZERO, EVEN_K, STEPS, COLS)
    else:
        out = _group_summed(accs, w0, w1, w2, w3, scale, neg, x_rows, o, x_t, k0, K, EVEN_K, STEPS, COLS)
    return out


@triton.jit
def _group_summed(accs, w0, w1, w2, w3, scale, neg, x_rows, o, x_t, k0, K, EVEN_K: tl.constexpr,
                  STEPS: tl.constexpr, COLS: tl.constexpr):
    """The accumulators plus STEPS K steps summed in float32 from the values as they are (128 + value), then
    scaled once: acc + scale * (C - offset * sums of x), the scales and negated offsets float32."""
    for s in tl.static_range(STEPS):
        words, pairs, pairs_2 = _step_operands(w0, w1, w2, w3, s, x_rows, o, x_t, k0, K, EVEN_K, COLS)
        if COLS == 16:
            if s == 0:  # a group's first products start from zero (no accumulator operands)
                sums = _asm(_X_SUMS_FIRST, [pairs])  # x's, shared by every rep of the thread
                sums_2 = _asm(_X_SUMS_FIRST, [pairs_2])
                c = _asm(_K_STEP_16_FIRST, [words, pairs, pairs_2], 4)
            else:
                sums = _asm(_X_SUMS, [pairs, sums])
                sums_2 = _asm(_X_SUMS, [pairs_2, sums_2])
                c = _asm(_K_STEP_16, [words, pairs, pairs_2, c[0], c[1], c[2], c[3]], 4)
        else:
            if s == 0:
                sums = _asm(_X_SUMS_FIRST, [pairs])
                c = _asm(_K_STEP_FIRST, [words, pairs], 2)
            else:
                sums = _asm(_X_SUMS, [pairs, sums])
                c = _asm(_K_STEP, [words, pairs, c[0], c[1]], 2)
    acc_a = _asm(_EPILOGUE_A, [scale, neg, c[0], sums, accs[0]])
    acc_b = _asm(_EPILOGUE_B, [scale, neg, c[1], sums, accs[1]])
    if COLS == 16:
        out = (acc_a, acc_b, _asm(_EPILOGUE_A, [scale, neg, c[2], sums_2, accs[2]]),
               _asm(_EPILOGUE_B, [scale, neg, c[3], sums_2, accs[3]]))
    else:
        out = (acc_a, acc_b)
    return out


@triton.jit
def _add_row(part, r, y_ptr, ws_ptr, n, ok, M, N, ATOMIC: tl.constexpr):
    """One of x's rows (r, per thread) of y's outputs n: added into ws (ATOMIC) or stored in y."""
    part = tl.reshape(part, n.shape)
    if ATOMIC:
        tl.atomic_add(ws_ptr + r * N + n, part, mask=ok & (r < M), sem="relaxed")
    else:
        tl.store(y_ptr + r * N + n, part.to(y_ptr.dtype.element_ty), mask=ok & (r < M))


@triton.jit
def _add_rows(accs, block: tl.constexpr, y_ptr, ws_ptr, n, ok, t, M, N, ATOMIC: tl.constexpr):
    """Column block `block`'s sums (units A and B) into rows 8 block + 2t and + 1 of y, or added into ws (ATOMIC):
    regathered so that element o of `even` is output n of row 2t (of the block), of `odd` of row 2t + 1."""
    even, odd = _asm(_REGATHER, [accs[2 * block], accs[2 * block + 1]], 2)
    _add_row(even, 8 * block + 2 * t, y_ptr, ws_ptr, n, ok, M, N, ATOMIC)
    _add_row(odd, 8 * block + 2 * t + 1, y_ptr, ws_ptr, n, ok, M, N, ATOMIC)


@triton.jit
def _finish_row(r, y_ptr, ws_ptr, n, ok, M, N):
    tl.store(y_ptr + r * N + n, _take_sums(ws_ptr + r * N + n, ok & (r < M)).to(y_ptr.dtype.element_ty),
             mask=ok & (r < M))


@triton.jit
def _finish_rows(block: tl.constexpr, y_ptr, ws_ptr, n, ok, t, M, N):
    """Column block `block`'s rows of y from the workspace, for the program that added its tile's last split."""
    _finish_row(8 * block + 2 * t, y_ptr, ws_ptr, n, ok, M, N)
    _finish_row(8 * block + 2 * t + 1, y_ptr, ws_ptr, n, ok, M, N)


@triton.jit
def wna16_mma_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, counter_ptr, product_ptr, M, N, K, stride_xm,
                          stride_wk, group_size, k_per_split, HAS_ZERO: tl.constexpr, ATOMIC: tl.constexpr,
                          FINISH: tl.constexpr, GATED: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                          REPS: tl.constexpr, GROUP_STEPS: tl.constexpr, STEPS: tl.constexpr, COLS: tl.constexpr,
                          PDL: tl.constexpr, PREFETCH: tl.constexpr = False, SCALED: tl.constexpr = False):
    """y[:M] = x[:M] W^T for M <= COLS (8 or 16) rows of bf16 x and int4 W (wna16's layout, words along N): a program takes
    32 * REPS outputs (a multiple of WARPS) and STEPS K steps of 32 inputs from program_id(1) * k_per_split,
    GROUP_STEPS to a quantization group (or 4, one scale for all of K). ATOMIC: the K split's sums are added into
    ws (float32), and with FINISH the program adding the tile's last split writes y; else stored in y. EVEN_K,
    EVEN_N: K and N whole tiles (no masks). GATED: x's rows are gate and up side by side, the input SwiGLU's
    product, which each program writes for its inputs to product_ptr ([M, K], a scratch of the call's) first.
    PREFETCH: each group's words and scales are loaded while the group before it computes (registers for two
    groups' words), so a program keeps loads in flight through its products; else after that group's products.
    SCALED: the values are scaled in bf16 before their products (Blocks.scaled_values), else each group is summed
    in float32 and scaled after."""
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
    # B's column g is x's row g (of block 2: 8 + g), its last row past M (those columns are not stored)
    if GATED:  # the pairs come from SwiGLU's product of gate and up, which the program writes first
        x_in = product_ptr
        stride_in = K
    else:
        x_in = x_ptr
        stride_in = stride_xm
    x_rows = (x_in + tl.minimum(x_i // 4, M - 1) * stride_in, x_in + tl.minimum(8 + x_i // 4, M - 1) * stride_in)
    x_t = x_i % 4
    zeros = tl.zeros([REPS * 32 // THREADS, THREADS, 4], dtype=tl.float32)
    accs = (zeros, zeros, zeros, zeros) if COLS == 16 else (zeros, zeros)
    loads = _group_loads(w_ptr, s_ptr, z_ptr, n, ok, t, k_begin, N, K, stride_wk, group_size, HAS_ZERO, EVEN_K,
                         GROUP_STEPS, SCALED)  # before the wait for the kernel before (PDL): x is its output, not W
    for step in tl.static_range(0, STEPS, GROUP_STEPS):
        current = loads
        if PREFETCH and step + GROUP_STEPS < STEPS:  # the next group's loads in flight while this one computes
            loads = _group_loads(w_ptr, s_ptr, z_ptr, n, ok, t, k_begin + 32 * (step + GROUP_STEPS), N, K,
                                 stride_wk, group_size, HAS_ZERO, EVEN_K, GROUP_STEPS, SCALED)
        accs = _group(accs, current, x_rows, o, x_t, k_begin + 32 * step, K,
                      (x_ptr, product_ptr, k_begin, M, stride_xm), GATED, EVEN_K, GROUP_STEPS, step == 0, PDL,
                      32 * STEPS, COLS, SCALED, HAS_ZERO)
        if not PREFETCH and step + GROUP_STEPS < STEPS:  # after this group's products, as before
            loads = _group_loads(w_ptr, s_ptr, z_ptr, n, ok, t, k_begin + 32 * (step + GROUP_STEPS), N, K,
                                 stride_wk, group_size, HAS_ZERO, EVEN_K, GROUP_STEPS, SCALED)
    for block in tl.static_range(COLS // 8):
        _add_rows(accs, block, y_ptr, ws_ptr, n, ok, t, M, N, ATOMIC)
    if ATOMIC and FINISH:
        if _last_split(counter_ptr + pid_n, tl.num_programs(1)):
            for block in tl.static_range(COLS // 8):
                _finish_rows(block, y_ptr, ws_ptr, n, ok, t, M, N)
