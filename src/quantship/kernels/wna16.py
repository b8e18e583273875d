"""Weight-only integer matmul (W4A16, W8A16): y = x @ dequantize(W)^T, dequantized in registers.

The weights stay packed on the device in one layout, made once at load time from the checkpoint's
compressed-tensors rows ([out, in/8] int32, value + 8 stored unsigned, element i at bits 4i):

    packed  int32 [ceil(K / P), N]   P = 32 // bits values per word; word (j, n) holds input columns
                                     j*P .. j*P+P-1 of output n, column j*P+i at bits i*bits, stored
                                     unsigned (value + 2^(bits-1)); K padded with zeros (value 0)
    scale   [G, N] in the model dtype, G = ceil(K / group_size)
    zero    [G, N] int8 signed like the values (asymmetric only), or None

It is compressed-tensors' packing transposed (as GPTQ and exllama hold it), so a tile of BLOCK_K
input rows by BLOCK_N outputs is one coalesced load of BLOCK_K / P rows of words. A tile never
straddles a quantization group (BLOCK_K divides the group), so the scale multiplies the tile's
partial dot product once per output instead of every weight.

Three kernels share the layout (_wna16_triton.py): a CUDA-core GEMV (plus a bf16x2 variant for one
row of bf16 x), a tensor-core tile for a few to 64 rows that takes x permuted per call (permute_x:
a copy of x, the weight stays as packed), and a dequantize pass that writes the bf16 weight once
for cuBLAS. A variant of the swap tile, "swap_x", reads x as it is and a K tile ahead (one vectorized
load, sliced per value position in registers), where the swap tile loads a slice of permuted x from
L2 before each of its 8 products (the compiled kernel shows each load, its shared-memory store and the
product's wait in series); the table takes it from 2 to 32 rows, where it measured faster. A third variant,
"swap_bf16x2" (int4, tiles inside one group), makes one product per K tile instead of one per value
position: the word tile is spread in registers so that each thread's operand pairs are two values of one
word, dequantized two per lop3 and bf16x2 subtraction, and x's tile is permuted to the same order (as
compiled for sm_90, about half the instructions of swap_x per K tile); from 32 rows the table gives it x
copied to that order once per call (pair_order_x), so its tiles go from memory to the product as loaded, and
from 16 rows its tiles of x and of the words come by TMA (tensor descriptors made per call, tma_fits); a TMA
tile may also walk equal runs of all the call's K tiles, output tile after output tile (Blocks.stream, stream-K:
a grid of as many programs as the GPU holds, no last part-empty wave, no pipeline refilled every few K tiles;
a sweep candidate until a GPU has timed it). The small-M ones split K over several programs and add partial
sums atomically (fp32), so a batch-1 product still fills the GPU; they gather scales per word row where a
tile spans quantization groups. Which runs for which M is a fixed table measured on an H200 and an H100
(benchmarks/kernel_wna16.py), with a GPU's own tiles for a class where its sweep beat the table's
(DEVICE_TILES, by device name), never tuned on the request path. `tinygemm_pack` makes the same int4
weight for PyTorch's own decode kernel; the sweeps found it faster at no row count worth its second
copy of the weights (TINYGEMM_MAX_M), so it serves as their reference.

Under programmatic dependent launch (kernels.dependent_launch: by default the GEMVs and the stream-K tile of the
classes whose Blocks.pdl is on, the other swap tiles and the dequantize pass with QUANTSHIP_PDL=1) the GEMVs load
their first K tile's words and scales before waiting for the kernel before, the swap tiles (the stream-K form too;
the TMA tile splitting K launches without it) prefetch their first tile's words into L2, and the dequantize pass
waits only before its stores: weights are never written during a step, x and the outputs may be.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from quantship.kernels import capability_major, dependent_launch, device_name, sm_count
from quantship.kernels.elementwise import reference_silu_mul


def words_per_column(in_features: int, bits: int) -> int:
    per_word = 32 // bits
    return -(-in_features // per_word)


# How the packed [K/P, N] words lie in memory: along N (False, GPTQ's order: a word row of every output
# contiguous), or along K (True: each output's words contiguous, compressed-tensors' own [N, K/P] rows held as a
# transposed view, so loading copies nothing and a tensor-core tile's words load as 16-byte vectors). The kernels
# index by strides and take either. Along N measured faster where it counts (H100, 6.7B shape, engine: batch 1
# 1.08x, batch 16 level, a 128-token prefill 2% slower; benchmarks/kernel_wna16.py words and engine_throughput.py
# quick --words time both).
WORDS_ALONG_K = False


def hold(packed: torch.Tensor, along_k: bool | None = None) -> torch.Tensor:
    """Packed words [K/P, N] laid out along K or along N (None: as WORDS_ALONG_K says); no copy where they are."""
    return packed.t().contiguous().t() if (WORDS_ALONG_K if along_k is None else along_k) else packed.contiguous()


def held_along_k(packed: torch.Tensor) -> bool:
    """Whether packed words [K/P, N] lie along K (each output's words contiguous; see WORDS_ALONG_K)."""
    return packed.shape[0] > 1 and packed.stride(0) == 1


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed integers [N, K] (int8) → packed int32 [ceil(K/P), N], held as `hold` lays it out."""
    per_word = 32 // bits
    n, k = values.shape
    rows = words_per_column(k, bits)
    unsigned = values.to(torch.int64) + (1 << (bits - 1))
    unsigned = F.pad(unsigned, (0, rows * per_word - k), value=1 << (bits - 1))
    shifts = torch.arange(per_word, dtype=torch.int64, device=values.device) * bits
    words = (unsigned.view(n, rows, per_word) << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement in 32 bits
    return hold(words.to(torch.int32).t())


def from_rows(rows: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' words [N, K/P] (K a whole number of words) → packed [K/P, N]: the same words,
    transposed (pack() of the unpacked values gives exactly this; this skips the unpack and repack): a view of
    the rows where the words are held along K, else a transposed copy."""
    return hold(rows.t())


def unpack(packed: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """Packed int32 [ceil(K/P), N] → signed integers [N, K] (int8)."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int32, device=packed.device) * bits
    unsigned = (packed[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
    values = unsigned.reshape(-1, packed.shape[1])[:in_features] - (1 << (bits - 1))
    return values.t().to(torch.int8)


def permute_x(x: torch.Tensor, bits: int, tile: int = 0) -> torch.Tensor:
    """x [M, K] with each block of 16P inputs reordered so that input j*P + i (value i of word row j)
    lands at 16*i + j, zero-padded to whole blocks (and whole tiles of `tile` inputs): the columns that
    value position i of 16 consecutive word rows multiplies become contiguous, which
    wna16_swap_dot_kernel loads straight into its tensor-core products, unmasked. One small copy of x
    per call instead of a repacked weight."""
    per_word = 32 // bits
    block = 16 * per_word
    m, k = x.shape
    padded = -(-k // max(block, tile)) * max(block, tile)
    if padded != k:
        x = F.pad(x, (0, padded - k))
    return x.reshape(m, padded // block, 16, per_word).transpose(2, 3).reshape(m, padded)


def pair_order_x(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] (K a multiple of 32) with each 32 inputs in swap_bf16x2's pair order: input 32b + 8t + 4h + 2c + d
    (value 4h + 2c + d of word row 4b + t) moves to 32b + 16c + 8d + 2t + h, where the tile's spread words put
    its weight (_pair_words, _pair_order_x in _wna16_triton.py). One copy of x per call."""
    m, k = x.shape
    return x.view(m, k // 32, 4, 2, 2, 2).permute(0, 1, 4, 5, 2, 3).reshape(m, k)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int,
               in_features: int, group_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [N, K] the packed tensors stand for (computed in float32; a transposed view).

    Worked in the packed [K, N] orientation throughout: no int8 round trip, one transpose at the end
    (this is the CPU forward of every packed Linear, so it is kept to a few passes)."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int32, device=packed.device) * bits
    unsigned = ((packed[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)).reshape(-1, packed.shape[1])
    weight = unsigned[:in_features].float() - (1 << (bits - 1))
    if in_features % group_size == 0:  # scales broadcast over each group's rows: no [K, N] copy of them
        grouped = weight.view(-1, group_size, weight.shape[1])
        if zero is not None:
            grouped -= zero.float()[:, None, :]
        grouped *= scale.float()[:, None, :]
        return weight.to(dtype).t()
    if zero is not None:
        weight -= zero.float().repeat_interleave(group_size, dim=0)[:in_features]
    weight *= scale.float().repeat_interleave(group_size, dim=0)[:in_features]
    return weight.to(dtype).t()


def reference_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                     bits: int, in_features: int, group_size: int) -> torch.Tensor:
    """What the kernel must equal: dequantize, then matmul, all in float32."""
    return F.linear(x.float(), dequantize(packed, scale, zero, bits, in_features, group_size))


@dataclass(frozen=True)
class Blocks:
    kind: str  # "gemv" (CUDA cores, a program per row of x), "gemv_bf16x2" (the int4 GEMV two values per
    # instruction, bf16 x on a GPU), "gemv_mma" (int4, up to 16 rows of bf16 x on tensor cores: wna16_mma),
    # "swap_dot" (tensor cores, the weight as the left operand, x permuted),
    # "swap_x" (the same products, x read as it is), "swap_bf16x2" (int4: one product per K tile, two values
    # dequantized per instruction; others take swap_x), "dequantize"
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1  # 0: as many splits as fill the GPU, at most K / (4 * block_k); -1: one K tile per program
    num_warps: int = 4
    num_stages: int = 3
    finish: bool = True  # a K split finished in the kernel (split_workspace); False: memset, kernel, cast
    rows_first: bool = False  # swap tiles over several row blocks of x: the grid walks the row blocks first,
    # so a weight tile's programs for every row block run together and all but one read it from L2
    x_paired: bool = False  # swap_bf16x2: x copied to the pair order once per call (pair_order_x, K a multiple of
    # 32) and read straight into the products, where each K tile of it would be permuted in registers and stored
    # back to shared memory (H100, a 6.7B layer's calls at 64 rows, the copy counted: 114.6 µs against 132.3)
    tma: bool = False  # swap_bf16x2: x's and the words' tiles copied by the Tensor Memory Accelerator (tensor
    # descriptors; wna16_swap_bf16x2_tma_kernel), where the tile's own threads compute each load's addresses and
    # masks; taken on Hopper and later (and the interpreter) where the tensors lie as TMA needs (tma_fits), else
    # the same tile loads through pointers
    stream: int = 0  # swap_bf16x2 through TMA: 0, a grid of K splits; n, n programs per multiprocessor walking
    # equal runs of all the call's K tiles, tile after tile (stream-K, wna16_swap_bf16x2_stream_kernel); where
    # TMA cannot take the tensors the K split stays
    max_registers: int = 0  # a cap on registers per thread (ptxas' maxnreg; 0: the compiler's own count): as
    # compiled for sm_90 in stop 44 the 16-row swap_bf16x2 tile took 130, two more than lets four of its programs
    # share a multiprocessor (its TMA form takes 127)
    scaled_values: bool = False  # gemv_mma: each value scaled in bf16 before its product ((q - z) * s rounded
    # once, as dequantize rounds it) and the products added straight into the program's accumulators, where False
    # sums a group's products in float32 and scales the sum: fewer registers (no group sums, no sums of x) for two
    # more instructions per value pair
    pdl: bool = False  # the stream-K tile launched under programmatic dependent launch by default (the other swap
    # tiles only with QUANTSHIP_PDL=1): a setting of the M class, measured in the engine (engine_throughput.py quick
    # --pdl), not by a sweep's calls of one shape in a row, so a sweep times every stream candidate of a class with
    # the class's setting and adopt keeps it for the tiles that take the class. On for 16 rows (H100: the batch-16
    # step 2.74 ms against 3.00 without); off for 64 (6.34 against 5.39 with it, the next kernel's early programs
    # slowing a longer, busier one)


GEMV_KINDS = ("gemv", "gemv_bf16x2")  # the kernels that take x a row per program, on CUDA cores

# M class (upper bound) → kernel and tiles: the winners of `benchmarks/kernel_wna16.py run --sweep` summed over
# the four Linear calls of a 6.7B decoder layer, written here by its `adopt` (BENCHMARKS.md has the runs). One
# row: the bf16x2 GEMV (an H200 sweep), and where its PTX cannot run (int8, fp16, off the GPU) the float32
# GEMV's own entry. 2 to 128 rows: swap_bf16x2 (an H100 sweep of it beside the earlier table, a layer's calls:
# 1.17x the swap_x tile's speed at 16 rows, 1.25x at 32, 1.18x the swap tile's at 64, 1.25x dequantize +
# cuBLAS's at 128, where later H100 sweeps took K split 4 over 2: 230-238 µs a layer against 280); where it
# cannot take the weight (int8, groups of 16) swap_x's products with the same tiles, or dequantize + cuBLAS past
# 64 rows. Past the last class dequantize + cuBLAS. From 32 rows x is copied to the pair order first (x_paired;
# an H100 sweep, stop 45, the copy counted: a layer's calls 114.6 µs against 132-135 at 64 rows, 213.6 against
# 230-238 at 128, level at 32). Since stop 46 the tiles load through TMA (Blocks.tma; an H100 sweep, a layer's
# calls: 68.7 against 74.4 µs at 16 rows, 90.3 against 92.2 at 32, 110.4 against 114.1 at 64, where two warp
# groups took the lead, 193.6 against 220.3 at 128, 128 deep). A tile 128 deep over 128 rows does not fit shared
# memory for float32 x: matmul takes it 64 deep there (swap_depth; tests/test_kernels_compile.py compiles every
# tile as launched for both). The same tile over two row blocks, K split 2, takes 129-256 rows (a layer's calls
# 329.9 µs against 370.6 for dequantize + cuBLAS at 256; at 2,048 it took 2,329 against 1,279).
BLOCKS_BY_M = [
    (1, Blocks("gemv_bf16x2", 1, 256, 128, -1, 4, 1)),
    (1, Blocks("gemv", 1, 256, 64, -1, 2, 1)),
    (16, Blocks("swap_bf16x2", 16, 128, 128, 8, 4, 3, tma=True, stream=3, pdl=True)),
    (32, Blocks("swap_bf16x2", 32, 128, 128, 4, 4, 3, tma=True)),
    (64, Blocks("swap_bf16x2", 64, 128, 128, 0, 8, 3, x_paired=True, tma=True, stream=2)),
    (256, Blocks("swap_bf16x2", 128, 128, 128, 2, 8, 3, finish=False, rows_first=True, x_paired=True, tma=True, stream=1)),
    (None, Blocks("dequantize", 0, 256, 64, 1, 4, 1)),
]


def dequantizes_from() -> int:
    """The fewest rows of x that may go to dequantize + cuBLAS, which writes the weight out dense for the
    call (the capacity planner reserves that copy): the first dequantize class, or the first swap_bf16x2 class
    of more than 64 rows, which hands it the weights it cannot take (int8, groups of 16). A sweep may give
    dequantize classes of their own (tiles or passes differing by M): the first one counts."""
    below = 0
    for limit, blocks in BLOCKS_BY_M:
        if blocks.kind == "dequantize" or (blocks.kind == "swap_bf16x2" and blocks.block_m > 64):
            return below + 1
        below = limit
    raise AssertionError("the table ends with dequantize + cuBLAS")


TARGET_PROGRAMS = 264  # two per multiprocessor of an H200: enough memory requests in flight


# A GPU's own tiles where its sweep chose others than BLOCKS_BY_M's, by torch.cuda.get_device_name: (M class,
# kind) → tiles of that kind for that class (`benchmarks/kernel_wna16.py adopt --device`). The H200, one row:
# 512 outputs by 64 inputs (a layer's four calls 44.5 µs against 47.8 for the table's 256 x 128; the engine's
# batch-1 W4A16 step 1.93-1.96 ms against 2.12, BENCHMARKS.md). The H100, one row: the GEMV on tensor cores (wna16_mma) in
# 512 x 256 tiles (44.7 µs a layer against 49.3 for its bf16x2 GEMV in 512 x 128; the engine's batch-1 step 1.89 ms
# against 2.17). Calls gemv_mma declines go to the shared table's GEMV (wna16.matmul).
DEVICE_TILES: dict[str, dict[tuple[int | None, str], Blocks]] = {
    "NVIDIA H200": {
        (1, "gemv_bf16x2"): Blocks("gemv_bf16x2", 1, 512, 64, -1, 4, 1),
    },
    "NVIDIA H100 80GB HBM3": {
        (1, "gemv_bf16x2"): Blocks("gemv_mma", 16, 512, 256, -1, 4, 1),
    },
}


def table_for(device: str | None = None) -> list[tuple[int | None, Blocks]]:
    """BLOCKS_BY_M with `device`'s own tiles (DEVICE_TILES) in the classes its sweep chose differently; the
    classes and their kinds stay the table's, so what dequantizes and from how many rows does not move."""
    own = DEVICE_TILES.get(device)
    if not own:  # the table itself: no list made per call (matmul asks on every launch)
        return BLOCKS_BY_M
    return [(limit, own.get((limit, b.kind), b)) for limit, b in BLOCKS_BY_M]


def choose_blocks(m: int, bf16x2: bool = True, device: str | None = None, mma: bool = True) -> Blocks:
    """The table's tiles for M rows on `device` (a GPU's name: table_for); without bf16x2 (its PTX takes
    int4 and bf16 x, on a GPU, as gemv_mma's does) one row takes the GEMV's entry, whose tiles were measured
    for every dtype; without mma, past any gemv_mma entry (what takes a call that kernel declines)."""
    return next(b for limit, b in table_for(device)
                if (limit is None or m <= limit) and (bf16x2 or b.kind not in ("gemv_bf16x2", "gemv_mma"))
                and (mma or b.kind != "gemv_mma"))


def supports(bits: int, group_size: int, in_features: int) -> bool:
    """Shapes the kernels take: 4 or 8 bits, per-channel or groups that a 16-wide tile divides."""
    return bits in (4, 8) and (group_size >= in_features or group_size % 16 == 0)


def pairs_fit(bits: int, group_size: int, in_features: int) -> bool:
    """Whether the swap_bf16x2 tile takes the weight: int4, its K tiles of 32 inputs or more inside one group."""
    return bits == 4 and (group_size >= in_features or group_size % 32 == 0)


def _block_k(blocks: Blocks, k: int, group_size: int) -> int:
    """The tile depth: the configured one, for the kernels that gather scales per word row; for the
    others the largest up to it that stays inside one group."""
    block_k = blocks.block_k
    if blocks.kind in GEMV_KINDS:
        return block_k
    while group_size < k and group_size % block_k:
        block_k //= 2
    return block_k


# Shared memory a swap_bf16x2 tile's stages may take, by the estimate in swap_depth: the 128-row tile 128 deep takes
# 123 KB of it for bf16 x and 216 KB for float32 x, which compiled for sm_90 needs 278 KB of the 227 KB there are
# (layout scratch besides the stages); at 64 deep, 108 KB.
SWAP_STAGE_BYTES = 192 << 10


def swap_depth(blocks: Blocks, block_k: int, x_bytes: int) -> int:
    """swap_bf16x2's tile depth for x of `x_bytes` per element: block_k, halved while its pipeline stages (x's
    [BM, BK] tile and the words' [BK/8, BN] each stage) would pass SWAP_STAGE_BYTES, so a table tile chosen for
    bf16 x also fits a float32 model's (tests/test_kernels_compile.py compiles both as launched)."""
    while block_k > 32 and blocks.num_stages * block_k * (blocks.block_m * x_bytes + blocks.block_n // 2) \
            > SWAP_STAGE_BYTES:
        block_k //= 2
    return block_k


def split_range(k: int, block_k: int, split: int) -> tuple[int, int]:
    """(inputs per split, a whole number of K tiles; the number of splits that makes) for about `split`."""
    steps = -(-k // block_k)
    per_split = -(-steps // max(1, split)) * block_k
    return per_split, -(-k // per_split)


def splits_for(blocks: Blocks, tiles: int, k: int, block_k: int) -> tuple[int, int]:
    """(K range per split, number of splits): enough programs to fill the GPU, at least 4 steps each."""
    steps = -(-k // block_k)
    split = steps if blocks.split_k < 0 else blocks.split_k or max(1, min(TARGET_PROGRAMS // tiles, steps // 4))
    return split_range(k, block_k, split)


_WORKSPACES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_OUTGROWN: list[tuple[torch.Tensor, torch.Tensor]] = []  # kept alive: a captured CUDA graph may still use one


def split_workspace(device: torch.device, sums: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The float32 sums and int32 per-tile counters a K split finishes through inside the kernel, for this
    device: zero between calls (the last program of each tile clears what it used), so one buffer serves
    every call in stream order. Grown outside CUDA-graph capture only (a buffer allocated during capture
    would be zeroed on replay, not now): None then, and the call takes memset + kernel + cast. The engine
    runs each batch shape eagerly before capturing it, so its graphs find the buffer grown."""
    held = _WORKSPACES.get(device)
    if held is not None and held[0].numel() >= sums and held[1].numel() >= tiles:
        return held
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    if held is not None:
        _OUTGROWN.append(held)
    sums, tiles = max(sums, 1 << 20, held[0].numel() if held else 0), max(tiles, 1 << 14, held[1].numel() if held else 0)
    _WORKSPACES[device] = (torch.zeros(sums, dtype=torch.float32, device=device),
                           torch.zeros(tiles, dtype=torch.int32, device=device))
    return _WORKSPACES[device]


def split_outputs(x2: torch.Tensor, n: int, tiles: int, finish: bool) -> tuple[torch.Tensor, torch.Tensor,
                                                                                torch.Tensor]:
    """(y, sums, counters) for a product of x2 [M, K] whose programs add partial sums of `tiles` output tiles: y in
    x's dtype and the device's workspace where the kernel finishes them (`finish`, and the workspace is there:
    split_workspace), else a zeroed float32 y they are added into (cast after), standing for all three."""
    m = x2.shape[0]
    workspace = split_workspace(x2.device, m * n, tiles) if finish else None
    if workspace is None:
        y = torch.zeros((m, n), dtype=torch.float32, device=x2.device)
        return y, y, y
    return torch.empty((m, n), dtype=x2.dtype, device=x2.device), *workspace


def dequantize_transposed(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int,
                          in_features: int, group_size: int, dtype: torch.dtype,
                          blocks: Blocks | None = None) -> torch.Tensor:
    """The weight transposed, [K, N] in `dtype`, through Triton (one pass: read packed, write dense); a
    stack of them ([E, K/P, N] packed, [E, G, N] scales: a layer's experts) into [E, K, N]."""
    import triton

    from quantship.kernels._wna16_triton import dequantize_kernel

    blocks = blocks or BLOCKS_BY_M[-1][1]
    n, k = packed.shape[-1], in_features
    block_k = _block_k(blocks, k, group_size)
    out = torch.empty(*packed.shape[:-2], k, n, dtype=dtype, device=packed.device)
    grid = (triton.cdiv(n, blocks.block_n), triton.cdiv(k, block_k), packed.shape[0] if packed.dim() == 3 else 1)
    if packed.dim() == 3:  # the kernel steps through a stack of experts as one contiguous block
        packed = packed.contiguous()
    dequantize_kernel[grid](packed, scale, zero if zero is not None else scale, out, n, k, packed.stride(-2),
                            packed.stride(-1), group_size, BITS=bits,
                            HAS_ZERO=zero is not None, BLOCK_N=blocks.block_n, BLOCK_K=block_k,
                            num_warps=blocks.num_warps, **dependent_launch(packed, default_off=True))
    return out


TINYGEMM_GROUPS = (32, 64, 128, 256)
TINYGEMM_MAX_M = 0  # rows up to which PyTorch's tinygemm beat every swept tile (kernel_wna16.py adopt; 0: never)


def _tinygemm_scales(scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """tinygemm computes (u - 8) * scale + offset from unsigned u = value + 8, so a zero point z becomes the
    offset -z * scale; both in bf16, [G, N, 2]."""
    scale = scale.to(torch.bfloat16)
    offset = torch.zeros_like(scale) if zero is None else -zero.to(torch.bfloat16) * scale
    return torch.stack([scale, offset], dim=-1).contiguous()


def tinygemm_pack(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, in_features: int,
                  group_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The same int4 weight in PyTorch's own decode kernel's layout (tinygemm, `torch._weight_int4pack_mm`,
    as gpt-fast and torchao use it), or None where this build or shape cannot take it."""
    if not (packed.is_cuda and hasattr(torch, "_weight_int4pack_mm") and group_size in TINYGEMM_GROUPS
            and in_features % 128 == 0 and packed.shape[1] % 8 == 0):
        return None
    unsigned = (unpack(packed, 4, in_features).to(torch.int32) + 8).to(torch.uint8)
    try:
        weight = torch._convert_weight_to_int4pack((unsigned[:, ::2] << 4 | unsigned[:, 1::2]).contiguous(), 8)
    except RuntimeError:  # a layout this PyTorch version does not take: the Triton kernels stay
        return None
    return weight, _tinygemm_scales(scale, zero)


def cpu_pack(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int, in_features: int,
             group_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The weight for PyTorch's CPU kernels, or None where this build or shape cannot take it: int4 for
    `_weight_int4pack_mm_for_cpu` (tinygemm's formula; outputs a multiple of 16, groups of 32-256), int8
    per channel and symmetric for `_weight_int8pack_mm` ([N, K] int8 and a scale per output). Both take
    bf16 activations. On a 2-core x86 host one 4096x4096 layer times one row takes about 1 ms either way,
    where dequantizing the weight for F.linear takes about 120 ms and float32 F.linear 2 ms
    (benchmarks/cpu_packed.py)."""
    ops = torch.ops.aten
    if packed.device.type != "cpu":
        return None
    if bits == 8:
        if not (hasattr(ops, "_weight_int8pack_mm") and zero is None and scale.shape[0] == 1):
            return None
        return unpack(packed, 8, in_features).contiguous(), scale[0].to(torch.bfloat16).contiguous()
    convert = getattr(ops, "_convert_weight_to_int4pack_for_cpu", None)
    if not (bits == 4 and convert is not None and hasattr(ops, "_weight_int4pack_mm_for_cpu")
            and group_size in TINYGEMM_GROUPS and in_features % group_size == 0 and packed.shape[1] % 16 == 0):
        return None
    unsigned = unpack(packed, 4, in_features).to(torch.int32) + 8
    try:
        weight = convert(unsigned.contiguous(), 1)
    except RuntimeError:  # a layout this PyTorch version does not take: dequantize + F.linear stays
        return None
    return weight, _tinygemm_scales(scale, zero)


def cpu_matmul(x: torch.Tensor, made: tuple[torch.Tensor, torch.Tensor], bits: int, group_size: int,
               out_features: int) -> torch.Tensor:
    """x [..., K] times a cpu_pack weight → [..., N] in x's dtype; x goes in as bf16, as W4A16/W8A16 say
    (the kernels' float32 paths measured 10-25x slower than their bf16 ones)."""
    rows = x.numel() // x.shape[-1]
    x2 = x.reshape(rows, -1).to(torch.bfloat16)
    weight, scales = made
    if bits == 8:
        y = torch.ops.aten._weight_int8pack_mm(x2, weight, scales)
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, weight, group_size, scales)
    return y.to(x.dtype).reshape(*x.shape[:-1], out_features)


def takes_gated(rows: int, x: torch.Tensor, bits: int) -> bool:
    """Whether matmul(gated=True) takes `rows` rows like x: only the GEMVs make SwiGLU's product in their
    loads of x (each input is loaded once per program there; a tensor-core tile would remake it per thread), and
    gemv_mma once per program into a scratch (where it declines a call, matmul makes the product first)."""
    return choose_blocks(rows, bits == 4 and x.dtype == torch.bfloat16 and x.is_cuda,
                         device_name(x)).kind in (*GEMV_KINDS, "gemv_mma")


_PAIRS_CHECKED: dict[tuple, bool] = {}


def checked_once(cache: dict, key, check) -> bool:
    """check() (a kernel against its reference) once per key, remembered in cache: never during CUDA-graph capture,
    where it could not run (False until an eager call has checked it, so the caller's other path takes the call)."""
    if key not in cache:
        if torch.cuda.is_current_stream_capturing():
            return False
        cache[key] = check()
    return cache[key]


def pairs_in_registers(x: torch.Tensor, blocks: Blocks, block_k: int) -> bool:
    """Whether swap_bf16x2 may make its values with the bf16x2 PTX for bf16 x: the PTX takes a register's two
    values as one word's pair, which holds only where Triton runs it on the operand registers of Hopper's
    wgmma (sm_90, 64 outputs a warp group: the compile test checks this Triton's layout). Elsewhere (mma.sync
    tiles of fewer outputs, other GPUs) its pairs would be other values. Another Triton may lay it out
    otherwise, so each tile shape is checked once per device against the shifts-and-masks path (never during
    CUDA-graph capture: the plain path takes those calls until an eager call has checked it)."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and blocks.block_n % (16 * blocks.num_warps) == 0
            and capability_major(x) == 9):
        return False
    checked = replace(blocks, block_k=block_k, split_k=1)  # the tile as launched: every field that shapes it
    return checked_once(_PAIRS_CHECKED, (x.device, checked), lambda: _pairs_agree(x.device, checked))


def _pairs_agree(device: torch.device, blocks: Blocks) -> bool:
    """One product of two K tiles, a tile of outputs, through the bf16x2 PTX and the plain path: the same
    exact values (q - 8 in bf16) into the same product, so within float32 rounding of each other."""
    g = torch.Generator().manual_seed(0)
    n, k = blocks.block_n, 2 * blocks.block_k
    packed = pack(torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8), 4).to(device)
    scale = torch.ones(1, n, dtype=torch.bfloat16, device=device)
    x = torch.randn(blocks.block_m, k, generator=g).to(device, torch.bfloat16)
    fast, plain = (matmul(x, packed, scale, None, 4, k, k, blocks, pairs_asm=asm).float() for asm in (True, False))
    return bool(((fast - plain).norm() <= 1e-3 * plain.norm()).item())


def tma_fits(x: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether swap_bf16x2's TMA tile takes x [M, K] and the packed words: a GPU with TMA (compute capability
    9.0 on; off the GPU, Triton's interpreter), and TMA copies from 16-byte aligned addresses with 16-byte
    aligned row strides, so x contiguous with K a multiple of 16 bytes, the words held along N (hold,
    WORDS_ALONG_K False) with N a multiple of 4, both starting at a 16-byte boundary."""
    return ((not x.is_cuda or capability_major(x) >= 9)
            and x.is_contiguous() and x.shape[1] * x.element_size() % 16 == 0 and x.data_ptr() % 16 == 0
            and not held_along_k(packed) and packed.stride(1) == 1 and packed.shape[1] % 4 == 0
            and packed.data_ptr() % 16 == 0)


def _swap_bf16x2_tma(x2: torch.Tensor, packed: torch.Tensor, blocks: Blocks, block_k: int, grid: tuple,
                     tail: tuple, common: dict, **constexprs) -> None:
    """Launches wna16_swap_bf16x2_tma_kernel: tensor descriptors for x's [BM, BK] tiles and the words'
    [BK/8, BN] tiles (TMA reads zeros past either tensor's edge), then `tail` (scales to the split's K range)
    and the launch options as the pointer tile takes them, but the loads' (EVEN_K, PDL)."""
    from quantship.kernels._wna16_triton import wna16_swap_bf16x2_tma_kernel

    options = {key: value for key, value in common.items() if key not in ("EVEN_K", "PDL", "launch_pdl")}
    wna16_swap_bf16x2_tma_kernel[grid](*_tile_descriptors(x2, packed, blocks, block_k), *tail, **options, **constexprs)


def _tile_descriptors(x2: torch.Tensor, packed: torch.Tensor, blocks: Blocks, block_k: int) -> tuple:
    """The TMA tiles' tensor descriptors: x's [BM, BK] tiles and the words' [BK/8, BN] (zeros past either edge)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return (TensorDescriptor.from_tensor(x2, [blocks.block_m, block_k]),
            TensorDescriptor.from_tensor(packed, [block_k // 8, blocks.block_n]))


def _pair_launch(x2: torch.Tensor, x: torch.Tensor, blocks: Blocks, block_k: int,
                 pairs_asm: bool | None) -> tuple[torch.Tensor, dict]:
    """swap_bf16x2's x as its kernels take it (copied to the pair order where the tile asks and K is whole pair
    blocks) and the constexprs that say how: X_PAIRED, and ASM (the bf16x2 PTX: pairs_asm, or its own check)."""
    paired = blocks.x_paired and x2.shape[1] % 32 == 0
    asm = pairs_in_registers(x, blocks, block_k) if pairs_asm is None else pairs_asm
    return (pair_order_x(x2) if paired else x2), {"X_PAIRED": paired, "ASM": asm}


# Whether the bf16x2 GEMV adds its K split's sums into the workspace four per vector reduction
# (red.global.add.v4.f32) rather than one atomic operation per sum (_quads): a quarter of the atomic traffic of its
# one-K-tile programs, which make one per 64 weights in an H200's 512x64 tiles. Off: on an H100 (stop 51) its test
# passed, the layer's calls took the same time (`kernel_wna16.py run --quads`) and the engine's batch-1 step was 1.3%
# shorter at level tok/s (`engine_throughput.py quick --quads`), 0.5% longer in stop 52 (both sides with a norm fold
# since reverted); the H200, whose own 512x64 tile makes twice the atomic adds of the H100's 512x128, has not timed it.
GEMV_QUADS = False


def _quads(n: int, blocks: Blocks, spans: bool) -> bool:
    """Whether a bf16x2 GEMV adds its sums four per vector reduction: N whole quads (16-byte aligned, the mask the
    same within each), and each thread holding whole quads of its tile's outputs, none held by two threads (the
    inline PTX has no guard against a value held twice, as tl.atomic_add has): a BN of whole multiples of 4 per
    thread, and no tile spanning groups, whose row sums come in a layout sliced from the 2-D accumulator."""
    return GEMV_QUADS and n % 4 == 0 and not spans and blocks.block_n % (4 * 32 * blocks.num_warps) == 0


# K tiles of its run whose words the stream kernel prefetches into L2 before it waits for the kernel before, under
# PDL: 4 made the batch-16 step 2.87 ms against 2.74 for 1 (quick --prefetch, the same run).
STREAM_PREFETCH = 1


def _swap_bf16x2_stream(x2: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                        group_size: int, blocks: Blocks, block_k: int, **constexprs) -> torch.Tensor:
    """wna16_swap_bf16x2_stream_kernel: blocks.stream programs per multiprocessor (no more than there are K tiles),
    each an equal run of the K tiles of every output tile in turn; y [M, N] in x's dtype."""
    from quantship.kernels._wna16_triton import wna16_swap_bf16x2_stream_kernel

    m, k, n = x2.shape[0], x2.shape[1], packed.shape[1]
    tiles = -(-m // blocks.block_m) * -(-n // blocks.block_n)
    steps = tiles * -(-k // block_k)
    per_program = -(-steps // min(steps, blocks.stream * sm_count(x2.device)))
    y, sums, counters = split_outputs(x2, n, tiles, finish=True)
    wna16_swap_bf16x2_stream_kernel[(-(-steps // per_program),)](
        *_tile_descriptors(x2, packed, blocks, block_k), scale, scale if zero is None else zero, y, sums, counters,
        m, n, k, group_size, per_program, packed, packed.stride(0), packed.stride(1), HAS_ZERO=zero is not None,
        FINISH=sums is not y, BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n, BLOCK_K=block_k,
        num_warps=blocks.num_warps, num_stages=blocks.num_stages, PREFETCH=STREAM_PREFETCH,
        **dependent_launch(x2, default_off=not blocks.pdl), **constexprs)
    return y.to(x2.dtype)


def matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int,
           in_features: int, group_size: int, blocks: Blocks | None = None, gated: bool = False,
           pairs_asm: bool | None = None) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) times the packed weight → [..., N] in x's dtype, through Triton.
    `gated`: x is [..., 2K], an MLP's gate and up side by side, and the input is SiLU(gate) * up, made by
    the GEMV as it loads x (rounded as elementwise.silu_mul rounds), one launch fewer (takes_gated).
    `pairs_asm`: swap_bf16x2 with its PTX or without (its own check); None: pairs_in_registers decides."""
    import triton

    from quantship.kernels import _wna16_triton as kernels

    shape = x.shape
    x2 = x.reshape(-1, 2 * in_features if gated else in_features).contiguous()
    m, n, k = x2.shape[0], packed.shape[1], in_features
    bf16x2 = bits == 4 and x.dtype == torch.bfloat16 and x.is_cuda  # what its PTX takes
    blocks = blocks or choose_blocks(m, bf16x2, device_name(x))
    if blocks.kind == "gemv_mma":  # tensor cores for up to 16 rows, where the kernel takes the call (wna16_mma)
        from quantship.kernels import wna16_mma

        if wna16_mma.takes(x2, packed, scale, zero, bits, group_size, k, blocks, gated):
            return wna16_mma.matmul(x2, packed, scale, zero, k, group_size, blocks, gated).reshape(*shape[:-1], n)
        blocks = choose_blocks(m, bf16x2, mma=False)  # else the shared table's other kernel for M
        if gated and blocks.kind not in GEMV_KINDS:  # which takes x as it is: SwiGLU's product first
            x2, gated = reference_silu_mul(x2[:, :k], x2[:, k:]).contiguous(), False
    if blocks.kind == "gemv_bf16x2" and not bf16x2:  # asked for by name (sweeps, tests): the same tiles
        blocks = replace(blocks, kind="gemv")
    if blocks.kind == "swap_bf16x2" and not pairs_fit(bits, group_size, k):  # a product per value position
        blocks = replace(blocks, kind="swap_x") if blocks.block_m <= 64 else BLOCKS_BY_M[-1][1]
    if gated and blocks.kind not in GEMV_KINDS:
        raise ValueError(f"a gated input takes the GEMV only, not {blocks.kind} (see takes_gated)")
    if blocks.kind == "dequantize":
        w = dequantize_transposed(packed, scale, zero, bits, k, group_size, x.dtype, blocks)
        return torch.mm(x2, w).reshape(*shape[:-1], n)
    block_k = _block_k(blocks, k, group_size)
    if blocks.kind == "swap_bf16x2":  # whole pair blocks of 32 inputs, inside one group (_block_k)
        block_k = max(32, swap_depth(blocks, block_k, x.element_size()))
        x2, pairs = _pair_launch(x2, x, blocks, block_k, pairs_asm)  # x as its kernels take it
        if blocks.stream and blocks.tma and tma_fits(x2, packed):
            y = _swap_bf16x2_stream(x2, packed, scale, zero, group_size, blocks, block_k, **pairs)
            return y.reshape(*shape[:-1], n)
    elif blocks.kind in ("swap_dot", "swap_x"):  # 16 word rows at least (a product's depth), so 128 inputs of 4 bits
        block = 16 * (32 // bits)
        block_k = max(block, block_k // block * block)
        if blocks.kind == "swap_dot":  # whole permutation blocks of x
            x2 = permute_x(x2, bits, block_k)
    gemv = blocks.kind in GEMV_KINDS
    rows = m if gemv else triton.cdiv(m, blocks.block_m)
    rows_first = blocks.rows_first and not gemv
    grid = (rows, triton.cdiv(n, blocks.block_n)) if rows_first else (triton.cdiv(n, blocks.block_n), rows)
    per_split, splits = splits_for(blocks, grid[0] * grid[1], k, block_k)
    if splits > 1:
        y, sums, counters = split_outputs(x2, n, grid[0] * grid[1], blocks.finish)
    else:
        y = sums = counters = torch.empty((m, n), dtype=x.dtype, device=x.device)
    common = dict(BITS=bits, HAS_ZERO=zero is not None, ATOMIC=splits > 1, FINISH=sums is not y,
                  BLOCK_N=blocks.block_n, BLOCK_K=block_k, num_warps=blocks.num_warps, num_stages=blocks.num_stages,
                  EVEN_K=k % block_k == 0, **dependent_launch(x, default_off=not gemv),
                  **({"maxnreg": blocks.max_registers} if blocks.max_registers and x.is_cuda else {}))
    grid = (*grid, splits)
    outputs = (scale, zero if zero is not None else scale, y, sums, counters, m, n, k)  # every kernel's, after x, w
    args = (x2, packed, *outputs, x2.stride(0), packed.stride(0), packed.stride(1), group_size, per_split)
    # A tile stays inside one group only if the groups are whole tiles (or one group spans all of K).
    spans = group_size < k and group_size % block_k != 0
    if blocks.kind == "gemv":
        kernels.wna16_gemv_kernel[grid](*args, SPANS=spans, GATED=gated, **common)
    elif blocks.kind == "gemv_bf16x2":
        common.pop("BITS")
        kernels.wna16_gemv_bf16x2_kernel[grid](*args, SPANS=spans, GATED=gated,
                                               QUADS=_quads(n, blocks, spans), **common)
    elif blocks.kind == "swap_bf16x2":
        common.pop("BITS")
        constexprs = dict(pairs, BLOCK_M=blocks.block_m, ROWS_FIRST=rows_first)
        if blocks.tma and tma_fits(x2, packed):  # x and the words as descriptors, no strides
            _swap_bf16x2_tma(x2, packed, blocks, block_k, grid, (*outputs, group_size, per_split), common,
                             **constexprs)
        else:
            kernels.wna16_swap_bf16x2_kernel[grid](*args, **constexprs, **common)
    elif blocks.kind == "swap_x":
        kernels.wna16_swap_x_kernel[grid](*args, SPANS=spans, BLOCK_M=blocks.block_m,
                                          ROWS_FIRST=rows_first, **common)
    else:
        kernels.wna16_swap_dot_kernel[grid](*args, SPANS=spans, BLOCK_M=blocks.block_m,
                                            ROWS_FIRST=rows_first, **common)
    return y.to(x.dtype).reshape(*shape[:-1], n)
