"""W4A16/W8A16 kernel: achieved weight bandwidth on the 6.7B Linear shapes, against bf16 F.linear and copy.

On the GPU machine (checks every shape against the float32 reference first, then times):
    PYTHONPATH=src python3 benchmarks/kernel_wna16.py run --out $OUT [--sweep]
Then here: .venv/bin/python benchmarks/kernel_wna16.py render
`adopt RESULT.json` writes a --sweep run's winners into kernels/wna16.py (the table by M and how many
rows go to tinygemm): on the GPU machine before engine_throughput.py in the same call, and here after.
`adopt --device RESULT.json` writes them as the swept GPU's own tiles instead (kernels/wna16.py
DEVICE_TILES): only classes where its fastest tiles of the table's kind beat the table's by 2%. Time the
engine with them (engine_throughput.py quick) before keeping them: a layer's calls timed alone are not
the decode step (an H100's 4% faster one-row tiles left its step unchanged).

Each variant is timed as CUDA-graph replays of calls that rotate over enough weight copies to leave
the L2 cache (60 MB) cold, so launch overhead and cache hits stay out; the median of several replays
is kept. GB/s counts the bytes a call must read: packed weight + scales (+ zero points) + x + y.
--sweep also times candidate tile shapes per M class on the four Linear calls of one decoder layer
(SWEEP_SHAPES) and prints the best by their sum, for the table kernels/wna16.py keeps (a few minutes more).
`words` times the table's kernels on those four calls with the packed words held along N and along K
(kernels/wna16.py WORDS_ALONG_K), alternating, into kernel_wna16_words.json (about a minute).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))

from _report import RESULTS, table, update_section  # noqa: E402

SHAPES = {"q/o_proj 4096x4096": (4096, 4096), "gate/up 11008x4096": (11008, 4096),
          "down 4096x11008": (4096, 11008), "fused qkv 12288x4096": (12288, 4096),
          "gate+up 22016x4096": (22016, 4096)}  # (out N, in K); the engine merges q/k/v and gate/up
MS = [1, 4, 8, 16, 32, 64, 256, 2048]
# The four calls one 6.7B decoder layer makes in the engine: a candidate's summed time is the layer's
# Linear time, so the sweep ranks tiles by what a decode step spends, across N from 4096 to 22016 (the
# split of K that fills the GPU at N = 4096 adds atomics and a float32 output where N alone would).
SWEEP_SHAPES = ("fused qkv 12288x4096", "q/o_proj 4096x4096", "gate+up 22016x4096", "down 4096x11008")
SWEEP_MS = (1, 4, 8, 16, 32, 64, 128, 256, 2048)  # 128 only when asked (--ms): a short prompt's dense calls
GROUP = 128


def copy_bandwidth() -> float:
    """Device-to-device copy, read + write bytes per second, timed eagerly: a copy captured in a CUDA
    graph becomes a memcpy node on the copy engines, which measured 2.8 TB/s here against 4.3 TB/s for
    the copy kernel PyTorch launches eagerly (and bf16 F.linear itself reads 3.6 TB/s)."""
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (start.elapsed_time(end) / 1e3)


def graph_time(call, copies: int, calls: int = 24, replays: int = 7) -> float:
    """Seconds per call: median over replays of a graph of `calls` calls rotating over `copies` inputs."""
    for i in range(2):
        call(i % copies)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i % copies)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def random_packed(n: int, k: int, bits: int, symmetric: bool, copies: int, keep_values: bool = False):
    from quantship.kernels import wna16

    qmax = 1 << (bits - 1)
    out = []
    for _ in range(copies):
        values = torch.randint(-qmax, qmax, (n, k), dtype=torch.int8, device="cuda")
        scale = (torch.rand(k // GROUP, n, device="cuda") * 0.01 + 0.001).to(torch.bfloat16)
        zero = None if symmetric else torch.randint(-qmax, qmax, (k // GROUP, n), dtype=torch.int8, device="cuda")
        out.append((wna16.pack(values, bits), scale, zero) + ((values,) if keep_values else ()))
    return out


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def check(weights, bits: int, k: int) -> float:
    """Worst relative error of the kernel against the float32 reference over the M classes."""
    from quantship.kernels import wna16

    packed, scale, zero = weights[0]
    worst = 0.0
    for m in (1, 7, 16, 33, 64, 300):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = wna16.reference_matmul(x, packed, scale, zero, bits, k, GROUP)
        out = wna16.matmul(x, packed, scale, zero, bits, k, GROUP).float()
        assert torch.isfinite(out).all()
        worst = max(worst, ((out - ref).norm() / ref.norm()).item())
    return worst


def candidates(m: int):
    """_tiles(m), each stream-K tile with the PDL setting of the table's class for M (Blocks.pdl): the engine
    measured it, and the tile that wins the class keeps it (adopt), so the sweep times them all with it."""
    from quantship.kernels.wna16 import choose_blocks

    pdl = choose_blocks(m, device=this_device()).pdl
    return [replace(b, pdl=pdl) if b.stream else b for b in _tiles(m)]


def _tiles(m: int):
    """Tile shapes worth timing for this M: the decode GEMVs (the float32 one and, at one row, the bf16x2
    one; one K tile per program or as many splits as fill the GPU), the swap tile (weight as the left
    tensor-core operand, x permuted) with as many rows as M needs, dequantize + cuBLAS from 32 rows on.
    Split K finishes in the kernel (Blocks.finish); the table's entry for this M also runs the old way
    (memset, kernel, cast), so the run shows what finishing in the kernel gained."""
    from quantship.kernels.wna16 import Blocks, choose_blocks

    entry = choose_blocks(m, device=this_device())
    out = [entry, replace(entry, finish=False)]
    if m <= 16:  # tensor cores for up to 16 rows (wna16_mma: a mma a word where the CUDA-core GEMV spends 4 FMAs and
        # a split): 256-1,024 outputs by 128-256 inputs a program (`--kinds gemv_mma`)
        out += [Blocks("gemv_mma", 16, bn, bk, -1, 4, 1) for bn in (256, 512, 1024) for bk in (128, 256)
                if bn * bk <= 512 * 256]
        # neither deeper programs at 16 rows (512-1,024 inputs: fewer K splits' atomic adds) nor capped registers
        # (more programs a multiprocessor, a few bytes spilled) came out ahead on an H100 (stop 54): not swept.
        # Two stages (each group's words loaded while the group before computes) and values scaled before their
        # products: the nearest of each on an H100 (stop 55: kernel_wna16_mma_stages_h100, none ahead; the
        # deeper two-stage tiles and 512x256 in two stages trailed further and are not swept)
        out.append(Blocks("gemv_mma", 16, 256, 256, -1, 4, 2))
        if m > 1:  # at 16 rows 256x256 in two stages takes 178 registers, 168 with no spill: 3 programs, not 2
            out += [Blocks("gemv_mma", 16, 256, 256, -1, 4, 2, max_registers=168),
                    Blocks("gemv_mma", 16, 256, 256, -1, 4, 1, scaled_values=True)]
    if m <= 4:
        out += [Blocks("gemv", 1, bn, bk, -1, warps, 1) for bn in (128, 256) for bk in (64, 128) for warps in (1, 2)]
    if m == 1:
        out += [Blocks("gemv_bf16x2", 1, bn, 128, split, warps, 1) for bn in (128, 256) for warps in (2, 4)
                for split in (-1, 0)]
        # more outputs per thread (4 or 8 where the table's has 2): x's loads and pairing, the same for every
        # output of a thread, are shared by more weights
        out += [Blocks("gemv_bf16x2", 1, bn, bk, -1, warps, 1) for bn, warps in ((256, 1), (256, 2), (512, 2),
                                                                                   (512, 4), (1024, 4))
                for bk in (64, 128)]
        # 256 inputs a program: twice the words in flight per thread, half the partial sums added atomically
        # (swept in stop 48, kernel_wna16_gemv_deep: none led; 512x128 tiles did, 6% ahead of the table's, and
        # 2-3% a batch-1 step in the engine: the H100's own tiles now)
        out += [Blocks("gemv_bf16x2", 1, bn, 256, -1, warps, 1) for bn, warps in ((128, 2), (128, 4), (256, 4),
                                                                                   (256, 8), (512, 8))]
        # registers capped so more programs share a multiprocessor: a GEMV program issues all its words' loads
        # before its sums, so resident programs are the bytes in flight. As Triton 3.6 compiles them for sm_90 the
        # H200's 512x64 tiles take 212 registers (2 programs of 4 warps a multiprocessor), 168 or 152 without
        # spilling (3), 128 with 25 spilled loads (4); the table's 256x128 and 256x64 (2 warps) take 254
        out += [Blocks("gemv_bf16x2", 1, bn, bk, -1, warps, 1, max_registers=cap)
                for bn, bk, warps, cap in ((512, 64, 4, 168), (512, 64, 4, 128), (256, 128, 4, 168),
                                           (256, 64, 2, 168), (256, 64, 2, 128), (512, 128, 4, 168))]
        # (narrow and deep tiles, 16-128 outputs by 256-2,048 inputs a program, were swept once with the words along
        # N and along K, kernel_wna16_narrow_h100 and _k: 16-140% behind the H100's 512x128, so no candidates)
        # (a few K tiles per program, K split 8 or 16, pipelined or not, were swept once, kernel_wna16_gemv_splits:
        # 15-45% behind one K tile per program, so no candidates)
        # the swap tile's bf16 pairs need far fewer instructions per value than the GEMV's float32 sums
        return out + [Blocks("swap_dot", 16, bn, bk, split, 4, 4) for bn in (64, 128) for bk in (128, 256)
                      for split in (0, 8)] + [Blocks(kind, 16, bn, 128 if kind == "swap_x" else 256, split, 4, 3)
                                              for kind in ("swap_x", "swap_bf16x2") for bn in (64, 128)
                                              for split in (0, 8)]
    if m > 64:
        # dequantize + cuBLAS, and the 64-row tensor-core tiles over several row blocks (a 128-token prompt's
        # dense calls), the grid walking the output tiles first or the row blocks (then the blocks of one
        # weight tile run together: it is read from memory once, from L2 after, as dequantize + cuBLAS reads
        # the packed weight once but writes and reads it again dense)
        return out + [Blocks("dequantize", 0, bn, bk, 1, 4, 1) for bn, bk in ((64, 64), (128, 128), (256, 64))] + [
            Blocks(kind, 64, bn, bk, 1, 4, 4 if kind == "swap_dot" else 3, rows_first=first)
            for kind in ("swap_dot", "swap_x") for bn in (64, 128) for bk in (128, 256) for first in (False, True)] + [
            # one product per K tile, two values per instruction: 64 or 128 rows of x a program (a wgmma's N)
            Blocks("swap_bf16x2", rows, bn, bk, split, warps, 3, rows_first=first)
            for rows, bn, warps in ((64, 128, 4), (128, 128, 8), (128, 64, 4)) for bk in (64, 128)
            for split in (1, 2) for first in (False, True) if split == 1 or rows == 128] + [
            # K split 4 and 8 (256 outputs over two warp groups were no candidates: as compiled for sm_90 they spill)
            Blocks("swap_bf16x2", 128, 128, bk, split, 8, 3, rows_first=True) for bk in (64, 128) for split in (4, 8)] + [
            # x copied to the pair order once per call, its tiles read straight into the products (`--kinds paired`)
            Blocks("swap_bf16x2", 128, 128, bk, split, 8, 3, finish=False, rows_first=True, x_paired=True)
            for bk in (64, 128) for split in (2, 4, 8)] + [
            # x and the words copied by TMA (`--kinds tma`), x copied to the pair order first or permuted per tile
            Blocks("swap_bf16x2", 128, 128, bk, split, 8, 3, finish=False, rows_first=True, x_paired=paired, tma=True)
            for bk in (64, 128) for split in (2, 4) for paired in (True, False)] + [
            # in equal runs of all the K tiles (`--kinds stream`; stop 48: one a multiprocessor, 13% ahead of K split)
            Blocks("swap_bf16x2", 128, 128, 128, 2, 8, 3, finish=False, rows_first=True, x_paired=paired, tma=True,
                   stream=per_sm) for per_sm in (1, 2) for paired in (True, False)]
    rows = 16 if m <= 16 else 32 if m <= 32 else 64
    # 0: as many splits as fill the GPU for this N (wna16.splits_for), 1: none (no atomics)
    splits = (0, 1, 4, 8) if m <= 16 else (0, 1, 2, 4)
    stages = (2, 4) if m <= 16 else (4,)
    out += [Blocks("swap_dot", rows, bn, bk, split, 4, stage) for bn in (64, 128) for bk in (128, 256)
            for split in splits for stage in stages]
    # the swap tile reading x as it is, a K tile ahead. Fewer K splits and deeper K tiles too: with 8 splits
    # of a 4,096-deep K in 256-deep tiles a program walks 2 tiles, too few for the pipeline's stages to
    # overlap its loads (the H100 profile: 85 µs a 6.7B layer at 16 rows, a third of the bytes' time)
    out += [Blocks("swap_x", rows, bn, bk, split, 4, stages) for bn in (64, 128) for bk in (128, 256, 512)
            for split in (0, 2, 4, 8) for stages in (3, 4)]
    # one product per K tile, its values two per bf16x2 instruction (about half the swap tiles' instructions)
    out += [Blocks("swap_bf16x2", rows, bn, bk, split, 4, 3) for bn in (64, 128) for bk in (128, 256)
            for split in (0, 4, 8)]
    if m > 16:  # two warp groups over 128 outputs: as compiled for sm_90 the 4-warp tiles of 32 and 64 rows spill
        # registers (255 and a stack), these take 125-199 and do not
        out += [Blocks("swap_bf16x2", rows, 128, bk, split, 8, 3) for bk in (64, 128, 256) for split in (0, 2, 4)]
    # (deeper pipelines over 64-deep tiles and two warp groups over 128 or 256 outputs were swept at 16 rows
    # once, kernel_wna16_bf16x2_m16, and none led: not candidates)
    # x copied to the pair order once per call (a small copy), its tiles then read straight into the products
    # (Blocks.x_paired; `--kinds paired` sweeps these alone beside the table's entry)
    out += [Blocks("swap_bf16x2", rows, 128, 128, split, warps, 3, x_paired=True) for warps in (4, 8)
            for split in ((0, 4, 8) if m <= 16 else (0, 2, 4)) if warps == 4 or m > 16]
    # x's and the words' tiles copied by TMA (Blocks.tma; `--kinds tma`): one thread issues a tile's copy where
    # every thread computes cp.async addresses and masks (the 16-row tile's compiled loop: 355 instructions a K
    # tile against 381)
    if m <= 16:
        out += [Blocks("swap_bf16x2", rows, 128, bk, split, 4, stages, tma=True) for bk in (128, 256)
                for split in (0, 4, 8) for stages in (3, 4)]
        out += [Blocks("swap_bf16x2", rows, 128, 128, split, 4, 3, x_paired=True, tma=True) for split in (0, 8)]
        # other widths, deeper or shallower pipelines and K split 16 (`--kinds tma`, a second look)
        out += [Blocks("swap_bf16x2", rows, bn, 128, split, warps, stages, tma=True)
                for bn, warps in ((64, 4), (128, 4), (256, 8)) for split in (8, 16) for stages in (2, 3, 5)]
    else:
        out += [Blocks("swap_bf16x2", rows, 128, bk, split, warps, stages, x_paired=True, tma=True)
                for warps, bk in ((4, 128), (8, 128), (8, 64)) for split in (0, 2, 4) for stages in (3, 4)]
        # x permuted per tile in the kernel, no copy per call: through TMA the compiled loop is about as long as
        # the paired tile's (Triton 3.6, sm_90: 385 against 384 instructions a K tile at 32 rows, 284 against 278
        # at 64 with two warp groups), where the copy costs 2-3 µs a call (stop 48: at 32 rows 8% ahead of the
        # paired tile, adopted)
        out += [Blocks("swap_bf16x2", rows, 128, 128, split, warps, 3, tma=True)
                for warps in ((4, 8) if rows == 32 else (8,)) for split in (0, 2, 4)]
    # the TMA tiles in equal runs of all the call's K tiles (Blocks.stream, `--kinds stream`): 2-4 programs a
    # multiprocessor at 16 rows (128 registers as compiled: four fit), 1-3 from 32; the K split is the fallback
    # where TMA cannot read the tensors (stop 48: 3 a multiprocessor won at 16 rows, 2 at 64; 2 at 32, where the
    # unpaired K split won over all). Fewer programs walk longer runs (a 6.7B layer's calls at 16 rows on 132
    # multiprocessors: 4-21 K tiles a run at 2, 2-11 at 4, where K split 8 walks 4 for three of them), with
    # deeper pipelines to keep as many bytes in flight
    if m <= 16:
        out += [Blocks("swap_bf16x2", rows, 128, 128, 8, 4, stages, tma=True, stream=per_sm)
                for per_sm, stages in ((2, 3), (2, 4), (2, 6), (3, 3), (3, 4), (4, 3), (4, 4))]
        # a second look around stop 48's winner (3 a multiprocessor, 3 stages): 64 outputs a tile (twice the
        # tiles, so shorter runs over each), 256-deep K tiles (twice the words a copy), 5 stages
        out += [Blocks("swap_bf16x2", rows, bn, bk, 8, 4, stages, tma=True, stream=per_sm)
                for bn, bk, stages, per_sm in ((64, 128, 3, 3), (64, 128, 3, 4), (64, 128, 4, 4), (128, 256, 3, 2),
                                               (128, 256, 3, 3), (128, 128, 5, 3))]
    else:
        out += [Blocks("swap_bf16x2", rows, 128, 128, 4 if rows == 32 else 0, warps, 3, x_paired=paired, tma=True,
                       stream=per_sm) for warps in ((4, 8) if rows == 32 else (8,)) for per_sm in (1, 2, 3)
                for paired in (True, False)]
    if m <= 16:  # the 16-row tiles held to 128 registers (130 as compiled): four programs a multiprocessor, not three
        out += [Blocks("swap_bf16x2", rows, 128, bk, split, 4, 3, max_registers=128) for bk in (128, 256)
                for split in (0, 4, 8)]
    if m >= 32:
        out += [Blocks("dequantize", 0, bn, bk, 1, 4, 1) for bn, bk in ((64, 64), (128, 128), (256, 64))]
    return out


def kind_of(blocks) -> str:
    """What `--kinds` names a candidate by: its kernel, "stream" for swap_bf16x2 through TMA in equal runs of all
    the K tiles (Blocks.stream), "tma" for swap_bf16x2 loading through TMA (Blocks.tma), or "paired" for
    swap_bf16x2 taking x copied to the pair order first (Blocks.x_paired)."""
    return "stream" if blocks.stream else "tma" if blocks.tma else "paired" if blocks.x_paired else blocks.kind


def tinygemm(x, values: torch.Tensor, scale: torch.Tensor):
    """PyTorch's own int4 matmul (tinygemm, used by gpt-fast and torchao) on the same weights, as a
    reference implementation; None where this PyTorch build lacks it."""
    try:
        unsigned = (values.to(torch.int32) + 8).to(torch.uint8)
        packed = torch._convert_weight_to_int4pack(unsigned[:, ::2] << 4 | unsigned[:, 1::2], 8)
        # tinygemm computes (q - 8) * scale + zero with q unsigned: symmetric → zero 0
        scales_and_zeros = torch.stack([scale, torch.zeros_like(scale)], dim=-1).contiguous()
        torch._weight_int4pack_mm(x, packed, GROUP, scales_and_zeros)
        return packed, scales_and_zeros
    except Exception as error:  # noqa: BLE001 (a missing op or layout is a reason to skip, not to stop)
        print("tinygemm unavailable:", type(error).__name__, str(error)[:200])
        return None


def time_shape(label: str, n: int, k: int, bandwidth: float, sweep: bool, kinds: tuple[str, ...] = (),
               ms: tuple[int, ...] = tuple(MS)) -> tuple[list[dict], dict]:
    from quantship.kernels import wna16, wna16_mma

    rows, sweep_times = [], {}
    w4 = random_packed(n, k, 4, True, copies=max(2, (256 << 20) // (n * k // 2)), keep_values=True)
    probe = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    tiny = [tinygemm(probe, w4[0][3], w4[0][1])]
    if tiny[0] is not None:
        tiny += [tinygemm(probe, v, s) for _, s, _, v in w4[1:]]
    w4 = [w[:3] for w in w4]
    w8 = random_packed(n, k, 8, True, copies=max(2, (256 << 20) // (n * k)))
    dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(max(2, (256 << 20) // (2 * n * k)))]
    errors = {"w4a16": check(w4, 4, k), "w8a16": check(w8, 8, k)}
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        io = nbytes(x) + m * n * 2
        t_dense = graph_time(lambda i: F.linear(x, dense[i]), len(dense))
        row = {"shape": label, "m": m, "bf16_s": t_dense, "bf16_gbs": (nbytes(dense[0]) + io) / t_dense / 1e9}
        for name, weights, bits in (("w4a16", w4, 4), ("w8a16", w8, 8)):
            t = graph_time(lambda i: wna16.matmul(x, *weights[i], bits, k, GROUP), len(weights))
            row[f"{name}_s"] = t
            row[f"{name}_gbs"] = (nbytes(*weights[0]) + io) / t / 1e9
        if tiny[0] is not None and m <= 256:
            t = graph_time(lambda i: torch._weight_int4pack_mm(x, tiny[i][0], GROUP, tiny[i][1]), len(tiny))
            row["tinygemm_s"] = t
            row["tinygemm_gbs"] = (nbytes(*w4[0]) + io) / t / 1e9
        row["copy_fraction_w4"] = row["w4a16_gbs"] * 1e9 / bandwidth
        rows.append(row)
        print({key: (f"{v:.3g}" if isinstance(v, float) else v) for key, v in row.items()}, flush=True)
        if sweep and m in SWEEP_MS and label in SWEEP_SHAPES:
            reference = wna16.reference_matmul(x, *w4[0], 4, k, GROUP)
            entry = wna16.choose_blocks(m, device=this_device())  # the table's entry, both ways, is timed in any sweep
            for blocks in dict.fromkeys(candidates(m)):  # the table's entry may be a candidate too
                if kinds and kind_of(blocks) not in kinds and blocks not in (entry, replace(entry, finish=False)):
                    continue
                if blocks.kind == "gemv_mma" and not wna16_mma.takes(x, *w4[0], 4, GROUP, k, blocks):
                    print("declined (another kernel would run)", blocks)  # its own check failed, or it cannot take x
                    continue
                try:
                    got = wna16.matmul(x, *w4[0], 4, k, GROUP, blocks=blocks).float()
                    error = ((got - reference).norm() / reference.norm()).item()
                    if not error < 1e-2:  # a fast wrong answer is no candidate
                        print("wrong", blocks, error)
                        continue
                    t = graph_time(lambda i: wna16.matmul(x, *w4[i], 4, k, GROUP, blocks=blocks), len(w4), replays=3)
                except Exception as error:  # a tile shape that does not compile here (shared memory)
                    print("skip", blocks, type(error).__name__)
                    continue
                sweep_times.setdefault(m, {})[blocks] = t
    return rows, {"errors": errors, "sweep": sweep_times}


def run(out: Path, sweep: bool, kinds: tuple[str, ...] = (), ms: tuple[int, ...] = tuple(MS),
        name: str = "kernel_wna16") -> None:
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    rows, errors, sweeps, shape_sweeps = [], {}, {}, {}
    for label, (n, k) in SHAPES.items():
        if kinds and label not in SWEEP_SHAPES:  # a partial sweep times the layer's four calls only
            continue
        shape_rows, extra = time_shape(label, n, k, bandwidth, sweep, kinds, ms)
        rows += shape_rows
        errors[label] = extra["errors"]
        if label in SWEEP_SHAPES and sweep:  # a candidate ranks only if it ran on every swept shape
            shape_sweeps[label] = extra["sweep"]
        for m, times in extra["sweep"].items():
            for blocks, t in times.items():
                sweeps.setdefault(m, {}).setdefault(blocks, 0.0)
                sweeps[m][blocks] += t
    ranking = {}
    for m, times in sweeps.items():
        everywhere = {b for b in times if all(b in per_shape.get(m, {}) for per_shape in shape_sweeps.values())}
        ranked = sorted(((b, t) for b, t in times.items() if b in everywhere), key=lambda kv: kv[1])
        ranking[m] = [(asdict(b), t) for b, t in ranked]
        print(f"M={m}: best tiles (summed over shapes): {[(repr(b), t) for b, t in ranked[:3]]}")
        if ranked:
            each = sum(min(per_shape[m].values()) for per_shape in shape_sweeps.values() if per_shape.get(m))
            print(f"M={m}: each shape's own fastest tiles would take {each * 1e6:.1f} µs against "
                  f"{ranked[0][1] * 1e6:.1f} for one tile shape (a table per shape's worth)")
    by_shape = {label: {m: [(asdict(b), t) for b, t in sorted(times.items(), key=lambda kv: kv[1])[:5]]
                        for m, times in per_shape.items()} for label, per_shape in shape_sweeps.items()}
    from quantship.kernels import dependent_launch, wna16

    result = {"device": torch.cuda.get_device_name(), "copy_bandwidth": bandwidth, "group_size": GROUP,
              "table": _table_text(wna16.table_for(this_device())),
              "errors": errors, "rows": rows, "ranking": ranking, "by_shape": by_shape,
              "sweep_shapes": list(SWEEP_SHAPES), "kinds": list(kinds),
              "words": "k" if wna16.WORDS_ALONG_K else "n",
              # programmatic dependent launch (kernels.dependent_launch): a layer's graphed GEMV calls overlap
              # each other by default; the tiles' only with QUANTSHIP_PDL=1
              "pdl": torch.cuda.is_available() and dependent_launch(torch.empty(0, device="cuda"))["PDL"],
              "gemv_quads": wna16.GEMV_QUADS,
              "pdl_tiles": torch.cuda.is_available() and dependent_launch(torch.empty(0, device="cuda"),
                                                                          default_off=True)["PDL"],
              "torch": torch.__version__}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    for label, e in errors.items():
        print(label, "relative error vs float32 reference:", e)


WORDS_MS = (1, 16, 32, 64, 128)


def words(out: Path, ms: tuple[int, ...] = WORDS_MS) -> None:
    """The table's kernel for each M on a layer's four calls (SWEEP_SHAPES) with the same int4 weights held
    along K (each output's words contiguous, compressed-tensors' own order) and along N (GPTQ's), alternating
    layouts per replay set: which layout kernels.wna16.WORDS_ALONG_K should hold."""
    from quantship.kernels import wna16

    torch.manual_seed(0)
    layer = {True: {}, False: {}}
    for label in SWEEP_SHAPES:
        n, k = SHAPES[label]
        copies = max(2, (256 << 20) // (n * k // 2))
        by_layout = {False: random_packed(n, k, 4, True, copies)}  # the same words, held the other way too:
        by_layout[True] = [(wna16.hold(packed, along_k=True), scale, zero) for packed, scale, zero in by_layout[False]]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            reference = wna16.reference_matmul(x, *by_layout[True][0], 4, k, GROUP)
            for along_k, weights in by_layout.items():  # the same values: the same answer either way
                got = wna16.matmul(x, *weights[0], 4, k, GROUP).float()
                assert ((got - reference).norm() / reference.norm()).item() < 1e-2, (label, m, along_k)
            times = {True: [], False: []}
            for _ in range(3):
                for along_k, weights in by_layout.items():
                    times[along_k].append(graph_time(lambda i: wna16.matmul(x, *weights[i], 4, k, GROUP),
                                                     len(weights), replays=3))
            for along_k in times:
                layer[along_k][m] = layer[along_k].get(m, 0.0) + statistics.median(times[along_k])
        print(label, {m: (layer[True][m], layer[False][m]) for m in ms}, flush=True)
    result = {"device": torch.cuda.get_device_name(), "group_size": GROUP,
              "table": _table_text(wna16.table_for(this_device())),
              "layer_s": {"k": layer[True], "n": layer[False]}, "shapes": list(SWEEP_SHAPES), "torch": torch.__version__}
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel_wna16_words.json").write_text(json.dumps(result, indent=2) + "\n")
    for m in ms:
        print(f"M={m}: along K {layer[True][m] * 1e6:.1f} µs, along N {layer[False][m] * 1e6:.1f} µs a layer")


def _words_text() -> list[str]:
    path = RESULTS / "kernel_wna16_words.json"
    if not path.exists():
        return []
    r = json.loads(path.read_text())
    k, n = r["layer_s"]["k"], r["layer_s"]["n"]
    rows = [[m, f"{n[m] * 1e6:.1f}", f"{k[m] * 1e6:.1f}", f"{n[m] / k[m]:.2f}x"] for m in k]
    return [f"The packed words' layout (`kernel_wna16.py words`, {r['device']}): the table's kernel for each M on "
            "a layer's four calls, the same int4 weights held along N (GPTQ's order, each word row of all outputs "
            "contiguous; `wna16.WORDS_ALONG_K` holds this one) and along K (compressed-tensors' own order, each "
            "output's words contiguous), alternating:", "",
            table(["M", "along N µs", "along K µs", "speed-up along K"], rows), "",
            "Along K every tile's words load as 16-byte vectors (the sm_90 compile test checks it), yet a layer's calls "
            "come out within 4% either way, and in the engine (`engine_throughput.py quick --words`, stop 43 in the "
            "quick re-runs) batch 1 decoded 7% slower along K and batch 16 level: the words stay along N.", ""]


REMOVED_KINDS = {"dot"}  # swept once and slower everywhere: gone from kernels.wna16


def runnable_ranking(r: dict) -> dict:
    """A --sweep run's candidates per M, fastest first, as Blocks the code can run: removed kernels and
    removed variants are left out: a swap tile with "pairs" on (int4 values made as bf16 pairs; other
    kernels ignored that field) and dequantize with "chunk_bytes" (passes of output columns through one
    L2-sized buffer: two H100 sweeps found them within 2-3% of the whole weight)."""
    from quantship.kernels.wna16 import Blocks

    fields = {f.name for f in dataclasses.fields(Blocks)}
    return {int(m): [(Blocks(**{k: v for k, v in b.items() if k in fields}), t) for b, t in items
                     if not (b.get("pairs") and b["kind"] == "swap_dot") and not b.get("chunk_bytes")
                     and b["kind"] not in REMOVED_KINDS]
            for m, items in r["ranking"].items()}


def _short(b) -> str:
    """A Blocks as kind and tiles only."""
    if b.kind == "dequantize":
        return "dequantize + cuBLAS"
    split = {-1: "a K tile per program", 0: "K split to fill the GPU", 1: "K unsplit"}.get(b.split_k,
                                                                                       f"K split {b.split_k}")
    rows = "" if b.kind.startswith("gemv") else f"{b.block_m} rows x "
    order = ", row blocks first" if b.rows_first and not b.stream else ""  # a stream run walks them first anyway
    cap = f", at most {b.max_registers} registers" if b.max_registers else ""
    if b.kind == "gemv_mma" and b.num_stages > 1:  # the others' stages are Triton's pipelining, not named here
        cap += ", each group's words loaded while the group before computes"
    if b.scaled_values:
        cap += ", values scaled before their products"
    if b.stream:  # the K split is only its fallback
        split = f"stream-K, {b.stream} program{'s' * (b.stream > 1)} a multiprocessor"
    return f"{b.kind} {rows}{b.block_n} outputs x {b.block_k} inputs, {split}{order}{cap}"


def _layer_rows(r: dict) -> list[list]:
    """Per swept M: one decoder layer's four Linear calls summed (µs), bf16 cuBLAS, tinygemm, the run's
    table, the sweep's fastest tiles (what `adopt` makes the table)."""
    rows = []
    for m, ranked in sorted(runnable_ranking(r).items()):
        calls = [row for row in r["rows"] if row["m"] == m and row["shape"] in r["sweep_shapes"]]
        dense = sum(row["bf16_s"] for row in calls)
        tiny = sum(row.get("tinygemm_s", float("nan")) for row in calls)
        fixed = sum(row["w4a16_s"] for row in calls)
        best, t = ranked[0]
        rows.append([m, f"{dense * 1e6:.1f}", f"{tiny * 1e6:.1f}", f"{fixed * 1e6:.1f}", f"{t * 1e6:.1f}",
                     _short(best), f"{dense / t:.2f}x"])
    return rows


def _sweep_text(r: dict) -> list[str]:
    """The --sweep's ranking as a table of one layer's Linear time."""
    if not r.get("ranking"):
        return ["No tile sweep in this run (`run --sweep` adds one).", ""]
    swept = r["sweep_shapes"]
    return [f"One decoder layer's Linear calls ({', '.join(swept)}) summed, microseconds, same run: bf16 cuBLAS, "
            "PyTorch's tinygemm, the table the run started with, and the fastest tiles of the sweep (`run "
            "--sweep`, every candidate checked against the reference first), which `adopt` wrote into "
            "kernels.wna16.", "",
            table(["M", "bf16 µs", "tinygemm µs", "run's table µs", "sweep's best µs", "sweep's best tiles",
                   "best vs bf16"], _layer_rows(r)), ""]


def _table_text(table) -> str:
    return "; ".join(f"M <= {limit}: {b}" if limit else f"larger M: {b}" for limit, b in table)


def _table_note(r: dict) -> str:
    """Whether the Triton columns ran with the table the code now has (runs before this key: unknown)."""
    from quantship.kernels.wna16 import table_for

    if r.get("table") == _table_text(table_for(r.get("device"))):
        return (f"The Triton columns ran with the table the code has now for the {r.get('device')} "
                "(kernels.wna16.table_for).")
    note = ("The Triton columns ran with the table the run started with; the code now has the sweep's winners "
            "(last column of the layer table below).")
    if "pairs=True" in r.get("table", "") and "swap_dot" in r.get("table", ""):
        note += (" In this run the swap tile made its int4 values as bf16 pairs in PTX (lop3, one bf16x2 FMA, "
                 "prmt: about half the instructions of the float32 route); the sweep timed both and the pairs "
                 "were slower at every M from 4 to 64 (8-35% per layer), so that code is gone and the 4-64 row "
                 "Triton columns understate the table now in use.")
    return note


# Sweeps of some kernels only (run --kinds ... --name NAME), rendered after the main run: file → what they timed.
PARTIAL_SWEEPS = {
    "kernel_wna16_dot": "two tensor-core tiles that read x as it is, beside the table (the swap tile from 2 to 64 "
                        "rows): `swap_x` (the swap tile's products, x loaded a K tile ahead in one vectorized load "
                        "and sliced per value position in registers, no permuted copy of x) and `dot` (x as the "
                        "left operand, the weight tile unpacked whole into the product's staged operand, one product "
                        "per K tile; slower at every M, so it is gone), plus one-row GEMVs with 4-8 outputs per "
                        "thread",
    "kernel_wna16_swap_x": "`swap_x` at 4 and 32 rows, its 16-row tiles already the table's",
    "kernel_wna16_stop38": "dequantize + cuBLAS (whole, and in passes of 8, 16 or 32 MB of output columns through "
                           "one reused buffer) and `swap_x`, after the GEMVs loaded x's K tile once (stop 38; the "
                           "one-row column is the table's bf16x2 GEMV). The passes stayed within 2-3% of "
                           "dequantizing the whole weight either way (32 MB) or lost (8 MB), and are gone; the "
                           "table dequantizes whole, now in 256x64 tiles",
    "kernel_wna16_bf16x2": "`swap_bf16x2` (stop 42: the swap tile's operands with one product per K tile, the word "
                           "tile spread in registers so each operand register holds two values of one word, made "
                           "by one lop3 and one bf16x2 subtraction; x's tile permuted to match) from 1 to 128 rows "
                           "beside the table it replaced from 2 to 128 rows",
    "kernel_wna16_bf16x2_m16": "`swap_bf16x2` at 16 rows with deeper pipelines over 64-deep tiles and two warp "
                               "groups over 128 or 256 outputs (stop 42, a second H100): none of them led; the best "
                               "(128 outputs, 256 deep, 8 splits) took 75.47 µs against the table's tiles' 75.53, "
                               "within noise, so the table stays",
    "kernel_wna16_m128": "the prefill rows with `swap_x` tiles of 128 rows of x (a wgmma's N of 128, each weight tile "
                         "dequantized once per 128 rows): 1.3x slower than dequantize + cuBLAS at 128 rows, 1.7x at "
                         "256 and 2.5x at 2,048, so they are no candidates any more",
    "kernel_wna16_m128_splits": "`swap_bf16x2` at 128 rows (a 128-token prompt's dense calls) with K split 4 (stop "
                                "43, run as `--name kernel_wna16_m128`, renamed here): 238 µs a layer against 280 "
                                "for the table's split 2, adopted; 256 outputs over two warp groups spill registers "
                                "as compiled for sm_90 and were left out",
    "kernel_wna16_warps": "`swap_bf16x2` at 32 and 64 rows with two warp groups over 128 outputs (stop 43: as "
                          "compiled for sm_90 the 4-warp tiles there spill registers, these do not) and at 128 rows "
                          "with K split 8: none led (the best 8-warp tiles 3-5% behind); the sweep's winners, "
                          "adopted, differ from the table's tiles by 0.5% at 64 rows and 2% at 128 (the K split "
                          "added into a zeroed float32 y, not finished in the kernel)",
    "kernel_wna16_registers": "`swap_bf16x2` at 16 rows with ptxas' register cap of 128 (stop 44, H100: the tile "
                              "compiles to 130 registers, two over four programs a multiprocessor): the capped "
                              "tiles ran 4% behind the uncapped ones (78.0 against 75.0 µs a layer), so occupancy "
                              "is not what holds the 16-row tile back, and the table stays",
    "kernel_wna16_h200_sweep": "the one-row GEMV and `swap_bf16x2` at 16 and 64 rows on an H200 (stop 44, the first "
                               "H200 since stop 39): one row fastest in 512x64 tiles (44.5 µs a layer against 47.8 "
                               "for the table's 256x128), adopted as the H200's own (`adopt --device`, "
                               "kernels.wna16.DEVICE_TILES); at 16 and 64 rows the table's tiles within 0.7% of the "
                               "fastest (noise), kept; the 16- and 64-row tiles take about the same time as on an H100 "
                               "(72 against 75 and 135 against 132 µs a layer), where bf16 reads 1.4x faster on the "
                               "H200",
    "kernel_wna16_paired": "`swap_bf16x2` from 16 to 128 rows with x copied to the pair order once per call "
                           "(`x_paired`, `--kinds paired`) beside the table's tiles, both loading each tile's scales "
                           "a tile ahead (stop 45, H100; the copy counted in each call; the table's tiles timed in "
                           "the sweep and, in the table below, in the run's rows): 114.6 against the table's 132.3 "
                           "µs a layer at 64 rows, 213.6 (128 deep) and 219.7 (64 deep) against 229.9 at 128, level "
                           "at 32 (92.4 against 92.1-92.9), behind at 16 (79.9 against 73.7-74.0); adopted from 32 "
                           "rows, the 128-row tile 64 deep (128 deep does not fit shared memory for float32 x). "
                           "Before it, ncu showed a scale load waited for in every K tile (Triton pipelines only the "
                           "loads that feed the product) and x's tiles permuted through registers and back to shared "
                           "memory; the same stop timed swap_bf16x2 on mma.sync (compiled with DISABLE_MMA_V3, its "
                           "values through shared memory): 3.3x slower at 16 rows, not kept",
    "kernel_wna16_gemv_splits": "the one-row GEMV with a few K tiles per program (K split 16 and 8, so 16 or 8 "
                                "partial sums added per output instead of 32; 1 or 3 pipeline stages) beside one K "
                                "tile per program (stop 45, H100): split 16 took 57.2-59.2 µs a layer, split 8 "
                                "71.8-72.2, one tile a program 49.6 (512 outputs) and 52.2 (the table's 256): the "
                                "atomic adds of the partial sums cost less than the parallelism they buy; no change",
    "kernel_wna16_tma": "`swap_bf16x2` from 16 to 128 rows with x's and the words' tiles copied by TMA (`tma`, "
                        "`--kinds tma`: tensor descriptors, one thread issuing each tile's copy where every thread "
                        "computed cp.async addresses and masks; the 16-row tile's compiled loop 355 instructions "
                        "a K tile against 381, and 127 registers against 167, four programs a multiprocessor) "
                        "beside the table's tiles (stop 46, H100): a layer's calls 68.7 against 74.4 µs at 16 "
                        "rows, 90.3 against 92.2 at 32, 110.4 against 114.1 at 64 (two warp groups), 193.6 "
                        "against 220.3 at 128 (128 deep: TMA's stages fit shared memory for bf16 x; float32 x "
                        "takes 64 deep, wna16.swap_depth); adopted from 16 to 128 rows",
    "kernel_wna16_tma2": "TMA tiles again (stop 46, H100, after adopting them): 64, 128 or 256 outputs, 2 to 5 "
                         "pipeline stages, K split 8 or 16 at 16 rows, 4 stages at 32 and 64: none led the "
                         "adopted tiles (69.0, 89.1 and 112.1 µs a layer); each shape's own fastest tiles would "
                         "take 65.5, 81.1 and 109.7 (mostly another K split for the widest and narrowest N)",
    "kernel_wna16_tma_prefill": "the TMA tile of 128 rows at 256 and 2,048 rows (two and sixteen row blocks, the "
                                "grid walking the row blocks first so a weight tile's second block finds it in L2) "
                                "beside dequantize + cuBLAS (stop 46, H100): at 256 rows K split 2 took 329.9 µs "
                                "a layer against 370.6, adopted as a class of its own (129-256 rows: prefill chunks "
                                "of that size); at 2,048 rows 2,329 against 1,279, dequantize + cuBLAS stays",
    "kernel_wna16_h100_m1": "the one-row GEMV on an H100 (stop 44): 512x128 tiles 4.4% faster than the table's "
                            "256x128 a layer (49.97 against 52.27 µs), but in the engine the batch-1 W4A16 decode "
                            "step was the same with them (2.176 against 2.174 ms, one machine, one run each), so "
                            "the H100 keeps the table's: the sweep's margin lets `adopt --device` take tiles, the "
                            "engine decides whether they go in",
    "kernel_wna16_stream_16_32": "`swap_bf16x2` through TMA in equal runs of all the K tiles (stream-K, `--kinds "
                                 "stream`, 2-4 programs a multiprocessor, 3-6 stages) at 16 and 32 rows beside the "
                                 "table's K split (stop 48, H100): 3 programs a multiprocessor with 3 stages took "
                                 "65.0 µs a layer at 16 rows against 68.7, 2 took 86.2 against 90.2 at 32; 4 a "
                                 "multiprocessor, as many as the registers let share one, ran 83.3 (runs of 2-11 K "
                                 "tiles are too short); adopted",
    "kernel_wna16_stream_64_256": "the stream-K tiles at 64, 128 and 256 rows (stop 48, H100, the same machine): 2 "
                                  "programs a multiprocessor 111.8 against 113.5 µs a layer at 64 rows (within "
                                  "noise, adopted as the sweep's fastest), one 170.3 against 194.9 at 128 and 275.7 "
                                  "against 322.3 at 256 (a run over both row blocks of a weight tile); adopted, one "
                                  "class from 65 to 256 rows",
    "kernel_wna16_tma_unpaired": "the TMA tiles taking x as it is, permuted per tile in the kernel (no pair-order "
                                 "copy per call; candidates since stop 46) at 32-256 rows beside the stream-K table "
                                 "(stop 48, H100): at 32 rows 80.4 against 87.0 µs a layer for the adopted paired "
                                 "stream tile, adopted (K split 4); at 64 rows and up the paired stream tiles led",
    "kernel_wna16_gemv_deep": "the one-row GEMV 256 inputs deep (twice the words in flight a thread, half the "
                              "partial sums added; candidates since stop 46) beside the other one-row tiles (stop "
                              "48, H100): none led; 512x128 ran fastest again, 49.3 against 52.4 µs a layer for the "
                              "table's 256x128; an engine run alternating both (`quick --wide-gemv`) then took the "
                              "batch-1 step 2.154 ms against 2.228 and 2.177 for two sides running the table's, so "
                              "the H100 takes it as its own (`adopt --device`)",
    "kernel_wna16_stream_second": "a second look at the stream-K tiles (stop 48, H100, after adopting them): at 16 "
                                  "rows 64 outputs a tile, 256 deep, 5 stages; from 32 rows x unpaired: none led by "
                                  "more than noise (16 rows the adopted tile first, 65.0 µs a layer; 32 rows unpaired "
                                  "in stream form 80.7 against 81.9 for the adopted K split; 64 rows 108.8-108.9 for "
                                  "the adopted tile), so the table stays",
    "kernel_wna16_gemv_registers": "the one-row GEMV's tiles with ptxas' register cap (stop 51, H100): 512x64 "
                                   "capped at 128 registers 49.67 µs a layer, uncapped 49.69, 512x128 (the "
                                   "H100's own tile) 50.34 in the sweep and 49.2 in the run's own rows, the "
                                   "table's 256x128 51.72: the cap changes nothing and the leaders are within "
                                   "noise, so DEVICE_TILES stays. The same machine timed the table's calls with "
                                   "the GEMV adding its sums four at once (`run --quads`): fused QKV 12.3 against "
                                   "12.2 µs, gate+up 19.1 against 18.8",
    "kernel_wna16_stream16": "the stream-K tiles at 16 rows (stop 51, H100): the table's 128x128, 3 stages, 3 "
                             "programs a multiprocessor, K split 8 finished in the kernel, under PDL led (58.45 µs "
                             "a layer; unfinished 58.61, 256 deep 58.88, 4 stages 61.59); the table stays",
    "kernel_wna16_narrow_h100": "the one-row GEMV in narrow, deep tiles (stop 52, H100; `--kinds narrow`, candidates "
                                "since removed): 16-128 outputs by 256-2,048 inputs a program, the same 4-16 KB of "
                                "words as the wide tiles with fewer partial sums (none for K up to the depth). The "
                                "H100's own 512x128 led at 49.8 µs a layer; the nearest, 64x256 with 2 warps, 57.6; "
                                "16x2048 76.9; 128x512 with 8 warps 111.4. In the engine (`quick --gemv-tile 64 256 "
                                "2`, the same machine, both sides with the norms made in the GEMVs that were then reverted) the "
                                "batch-1 step took 2.42 ms against 2.24",
    "kernel_wna16_narrow_k_h100": "the same narrow tiles with the packed words held along K (`--words k`), each "
                                  "output's words contiguous for a deep tile's loads: 512x128 59.0 µs a layer, the "
                                  "narrow ones 65.3-119.6. Neither layout lets a narrow tile lead",
    "kernel_wna16_mma_h100": "the GEMV on tensor cores (`gemv_mma`, kernels.wna16_mma; stop 53, H100, `--kinds "
                             "gemv_mma --ms 1 16`): at one row 512x256 took 44.8 µs a layer against 49.5 for the "
                             "H100's bf16x2 GEMV (1.10x; 512x128 45.2, 256x128 45.9), ahead on every one of the four "
                             "shapes; at 16 rows 76.4 against 58.8 for the stream-K swap tile, behind on all four",
    "kernel_wna16_mma_h100_m1": "the same at one row on stop 54's code (the part-empty K split's scales masked), "
                                "H100: 512x256 44.7 µs a layer against 49.3 for its bf16x2 GEMV in the same run; "
                                "the engine's batch-1 decode step took 1.89 ms with it against 2.17 with the H100's "
                                "bf16x2 GEMV (engine_throughput quick, stop 54), so `adopt --device` made it the "
                                "H100's one-row tile",
    "kernel_wna16_mma_deep_h100": "gemv_mma at 16 rows in deeper programs, 128-256 outputs by 512-1,024 inputs (stop "
                                  "54, H100): fewer K splits, so fewer atomic adds of float32 sums (an ncu profile "
                                  "of the 16-row gate+up call, 512x256: 1.05 M reduction sectors into L2 against "
                                  "66 K at one row). No faster: down 17.4 µs in 128x1024 against 17.1 in 256x256, "
                                  "the stream-K swap tile 13.4; the sums' reductions are not what holds it back",
    "kernel_wna16_mma_caps_h100": "gemv_mma with registers capped (stop 54, H100): the profile put the 16-row "
                                  "512x256 program at 255 registers (2 programs a multiprocessor, 11% of the "
                                  "warps it could hold, DRAM 44% busy; one row 160 registers, 3 programs, DRAM "
                                  "64%). Capped at 128 or 168 (3-4 programs, 8-512 bytes spilled a thread) it was "
                                  "slower at both one and 16 rows: 16 rows 78.1 µs a layer at best against 77.7 "
                                  "uncapped and 60.4 for the stream-K swap tile",
    "kernel_wna16_mma_stages_h100": "gemv_mma with each group's words loaded while the group before computes (two "
                                    "stages) and with its values scaled in bf16 before their products (no group "
                                    "sums or sums of x: fewer registers, two more instructions a value pair); stop "
                                    "55, H100. One row: 512x256 in one stage still led (45.7 µs a layer); two "
                                    "stages took 256x256 from 54.2 to 46.0 but 512x256 from 45.7 to 52.4. 16 rows: "
                                    "the stream-K swap tile 60.0; gemv_mma at best 70.3 (256x256, values scaled; "
                                    "77.4 unscaled), 72.1 in two stages capped at 168 registers. Nothing adopted",
}


def _kind_rows(r: dict) -> tuple[list[str], list[list]]:
    """Per swept M: the layer's four calls summed (µs) in bf16, with the run's table, and the fastest
    tiles of each kernel the sweep timed (removed ones included: what they measured is why they went)."""
    kinds = list(dict.fromkeys(b["kind"] for items in r["ranking"].values() for b, _ in items))
    rows = []
    for m, items in sorted(r["ranking"].items(), key=lambda kv: int(kv[0])):
        calls = [row for row in r["rows"] if row["m"] == int(m) and row["shape"] in r["sweep_shapes"]]
        dense = sum(row["bf16_s"] for row in calls)
        row = [m, f"{dense * 1e6:.1f}", f"{sum(c['w4a16_s'] for c in calls) * 1e6:.1f}"]
        for kind in kinds:
            t = min((t for b, t in items if b["kind"] == kind), default=None)
            row.append("-" if t is None else f"{t * 1e6:.1f} ({dense / t:.2f}x)")
        rows.append(row)
    return ["M", "bf16 µs", "run's table µs", *(f"fastest {k} µs (vs bf16)" for k in kinds)], rows


def _partial_sweep_text() -> list[str]:
    parts = []
    for name, what in PARTIAL_SWEEPS.items():
        path = RESULTS / f"{name}.json"
        if not path.exists():
            continue
        r = json.loads(path.read_text())
        header, rows = _kind_rows(r)
        parts += [f"A sweep of {what} (`run --sweep --kinds {' '.join(r.get('kinds', []))} --name {name}`, "
                  f"{r['device']}; one layer's four calls summed; the run's table is the table it started with):",
                  "", table(header, rows), ""]
    return parts


CURRENT_RUN = "kernel_wna16_current.json"  # `run --name kernel_wna16_current`: the table the code has now, no sweep


def _current_text() -> list[str]:
    """The newest run of the table as the code has it (no sweep): per call at 1, 16 and 64 rows the GB/s of the
    bytes it must read against the copy bandwidth and bf16 cuBLAS, and a 6.7B layer's four calls at every M."""
    path = RESULTS / CURRENT_RUN
    if not path.exists():
        return []
    r = json.loads(path.read_text())
    bandwidth = r["copy_bandwidth"]
    rows = [[row["shape"], row["m"], f"{row['bf16_s'] * 1e6:.1f}", f"{row['w4a16_s'] * 1e6:.1f}",
             f"{row['w4a16_gbs']:.0f}", f"{row['w4a16_gbs'] * 1e9 / bandwidth:.0%}", f"{row['bf16_gbs']:.0f}",
             f"{row['w8a16_gbs']:.0f}", f"{row['tinygemm_gbs']:.0f}" if "tinygemm_gbs" in row else "-",
             f"{row['bf16_s'] / row['w4a16_s']:.2f}x"]
            for row in r["rows"] if row["m"] in (1, 16, 64) and row["shape"] != "gate/up 11008x4096"]
    layer = []
    for m in sorted({row["m"] for row in r["rows"]}):
        calls = [row for row in r["rows"] if row["m"] == m and row["shape"] in SWEEP_SHAPES]
        if len(calls) == len(SWEEP_SHAPES):
            w4, bf16 = sum(c["w4a16_s"] for c in calls), sum(c["bf16_s"] for c in calls)
            layer.append([m, f"{bf16 * 1e6:.1f}", f"{w4 * 1e6:.1f}", f"{bf16 / w4:.2f}x"])
    from quantship.kernels.wna16 import table_for

    whose = ("the kernel table as the code has it now" if r.get("table") == _table_text(table_for(r["device"]))
             else "the kernel table as it stood then (the code's table has changed since; the run's is named below)")
    return [f"A run of {whose} (`run --name kernel_wna16_current`, no sweep; **{r['device']}**, "
            f"copy bandwidth {bandwidth / 1e12:.2f} TB/s in the same run; group {r['group_size']}, symmetric; "
            "CUDA-graph replays over weight copies that leave the L2 cold). GB/s counts the bytes each call must "
            "read (packed weight + scales + activations, bf16 weight for cuBLAS); the 6.7B shapes the engine runs "
            "(q/k/v and gate/up merged):", "",
            table(["Linear (out x in)", "M", "bf16 F.linear µs", "W4A16 µs", "W4A16 GB/s", "of copy bandwidth",
                   "bf16 GB/s", "W8A16 GB/s", "tinygemm W4 GB/s", "W4A16 speed-up over bf16"], rows), "",
            "One 6.7B decoder layer's four calls (fused qkv, o_proj, gate+up, down), summed:", "",
            table(["M", "bf16 µs", "W4A16 µs", "W4A16 speed-up"], layer), "",
            f"Its table: {r['table']}.", ""]


def render() -> None:
    r = json.loads((RESULTS / "kernel_wna16.json").read_text())
    rows = []
    for row in r["rows"]:
        if row["m"] > 64:
            continue
        tiny = f"{row['tinygemm_gbs']:.0f}" if "tinygemm_gbs" in row else "-"
        tiny_speed = f"{row['bf16_s'] / row['tinygemm_s']:.2f}x" if "tinygemm_s" in row else "-"
        rows.append([row["shape"], row["m"], f"{row['bf16_gbs']:.0f}", f"{row['w4a16_gbs']:.0f}", tiny,
                     f"{row['w8a16_gbs']:.0f}", f"{row['bf16_s'] / row['w4a16_s']:.2f}x", tiny_speed])
    prefill = [[row["shape"], row["m"], f"{row['bf16_s'] * 1e6:.0f}", f"{row['w4a16_s'] * 1e6:.0f}",
                f"{row['bf16_s'] / row['w4a16_s']:.2f}x"] for row in r["rows"] if row["m"] == 2048]
    parts = ["## W4A16 / W8A16 kernel (Triton, dequantize in registers)", "", *_current_text(),
             "An earlier full run with its sweep, the code and table of its time (the prose after it is of that "
             f"time too): **{r['device']}**, group {r['group_size']}, symmetric; GB/s of the bytes each call must read (packed "
             "weight + scales + activations). CUDA-graph replays over weight copies that leave the L2 cold. "
             "Speed-ups are bf16 F.linear's time over the kernel's, same run. `python benchmarks/kernel_wna16.py "
             "run`.", "",
             table(["Linear (out x in)", "M", "bf16 F.linear GB/s", "W4A16 Triton GB/s", "W4A16 tinygemm GB/s",
                    "W8A16 Triton GB/s", "Triton W4A16 speed-up over bf16", "tinygemm speed-up over bf16"],
                   rows), "",
             "Triton columns are the kernel table of the run: at one row the bf16x2 GEMV (one K tile per "
             "program, two int4 values per PTX instruction, the many-small-programs shape GemLite calls reverse "
             "split-K), from 2 to 64 rows the swap tile (y^T = W x^T on tensor cores: the weight tile fills the "
             "instruction's 64-row side, x permuted per call so each product's inputs are contiguous), past 64 rows "
             "dequantize + cuBLAS; the W8A16 column runs the float32 GEMV at one row. A K split now finishes in "
             "the kernel: partial sums go into a float32 workspace and the last program of each output tile "
             "writes it in the model's dtype and clears what it used (one launch where a memset, the kernel and "
             "a cast were three; the sweep times the table's tiles both ways: from 3% slower at 4-16 rows to 3-11% "
             "faster at 1, 32 and 64 rows over a layer, and the winners it adopted all finish in the kernel). "
             + _table_note(r), "",
             *_sweep_text(r),
             *_partial_sweep_text(),
             *_words_text(),
             "Since those sweeps the table took `swap_x` from 2 to 32 rows and kept the swap tile at 64, and since "
             "stop 42 it takes `swap_bf16x2` from 2 to 128 rows (the partial sweeps below); the engine section's "
             "H100 quick runs show the decode step with each. The H200 "
             "figures below are from before it, and from before the GEMVs loaded x's K tile once (stop 38: 23-44% "
             "fewer instructions in their compiled PTX). The H100 sweep of stop 39 (the partial sweep below) timed "
             "the new GEMV at one row: 56 µs for a layer's four calls against 159 µs of bf16 cuBLAS (2.8x), "
             "1.2-2.2 TB/s per call of the H100's 3.0 TB/s copy bandwidth.", "",
             "At one row the GEMV is about 1.9x bf16 cuBLAS over a layer, faster than tinygemm, and still reads "
             "well under the copy bandwidth (1.1-1.9 TB/s of 4.3 per call); from 4 to 16 rows the swap tile is "
             "level with bf16 to 1.16x faster, and at 32-64 rows slower than bf16 (0.9x, 0.73x over a layer). "
             "tinygemm is faster only at 4 rows, by about 9%, and would need a second copy of the int4 weights: "
             "the table no longer uses it (TINYGEMM_MAX_M 0). What separates these figures from the bytes is the "
             "dequantization's instructions and latency in Triton's layouts; a Marlin-class kernel (weights "
             "pre-shuffled into the tensor-core fragment order) is the known next step.", "",
             "Prefill-sized calls, microseconds: W4A16 (dequantize once in Triton, then cuBLAS) against bf16 "
             "cuBLAS.", "",
             table(["Linear", "M", "bf16 µs", "W4A16 µs", "W4A16 / bf16 speed"], prefill)]
    update_section("kernel_wna16", "\n".join(parts))


def _source(b) -> str:
    """A Blocks as kernels/wna16.py writes it."""
    text = f'Blocks("{b.kind}", {b.block_m}, {b.block_n}, {b.block_k}, {b.split_k}, {b.num_warps}, {b.num_stages}'
    # every later field that differs from its default, by name (a field added to Blocks is written too)
    named = [f for f in dataclasses.fields(b)][7:]
    return text + "".join(f", {f.name}={getattr(b, f.name)!r}" for f in named if getattr(b, f.name) != f.default) + ")"


def adopted_table(r: dict, current: list | None = None):
    """The table a sweep's run measured best: per swept M the fastest tiles summed over the layer's four
    calls (at one row also the fastest float32 GEMV, for what the bf16x2 PTX cannot take), the fastest
    dequantize + cuBLAS for M past the last; and the most rows for which tinygemm beat them all (from one
    row up; 0: never). A class of the `current` table (kernels/wna16.py's) whose M the run did not sweep
    (--ms) keeps its tiles: a sweep of some rows says nothing about the others. Classes past the last swept M
    go to dequantize + cuBLAS only where it won that M."""
    from quantship.kernels.wna16 import BLOCKS_BY_M, choose_blocks

    current = BLOCKS_BY_M if current is None else current
    ranking = runnable_ranking(r)

    def canonical(b):  # finish means nothing to dequantize + cuBLAS (no split): the default, whichever ran
        return replace(b, finish=True) if b.kind == "dequantize" else b

    def fastest(m, kind, default):  # a sweep of some kernels only (--kinds) keeps the table's entry for the rest
        return next((b for b, _ in ranking.get(m, []) if b.kind == kind), default)

    last = max(ranking)
    # past the last swept M the table dequantizes if the sweep got there (dequantize + cuBLAS won its last M);
    # where it stopped short of it (--ms 16 32), the classes above are the table's, unswept
    reached = ranking[last][0][0].kind == "dequantize"
    unswept = [(limit, b) for limit, b in current if limit is not None and limit not in ranking
               and (limit < last or not reached)]
    table = []
    for m in sorted({*ranking, *(limit for limit, _ in unswept)}):
        if m not in ranking:  # every entry of that limit (one row has a bf16x2 and a float32 GEMV)
            table += [entry for entry in unswept if entry[0] == m]
            continue
        table.append((m, class_pdl(canonical(ranking[m][0][0]), m, current)))
        if m == 1:
            table.append((1, fastest(1, "gemv", choose_blocks(1, bf16x2=False))))
    table.append((None, canonical(fastest(last, "dequantize", current[-1][1])) if reached else current[-1][1]))
    merged = []  # consecutive M classes with the same tiles are one entry, the larger limit
    for limit, b in table:
        if merged and merged[-1][1] == b and merged[-1][0] is not None and b.kind != "gemv":
            merged[-1] = (limit, b)
        else:
            merged.append((limit, b))
    tinygemm_rows = 0
    for m in sorted(ranking):
        tiny = [row.get("tinygemm_s") for row in r["rows"] if row["m"] == m and row["shape"] in r["sweep_shapes"]]
        if None in tiny or not tiny or sum(tiny) >= ranking[m][0][1]:
            break
        tinygemm_rows = m
    return merged, tinygemm_rows


def class_pdl(b, limit: int | None, table: list):
    """b taking the M class `limit` of `table`: a stream-K tile with the class's PDL setting (Blocks.pdl, measured
    in the engine), whatever the sweep's run recorded; other tiles as they are."""
    if not b.stream:
        return b
    return replace(b, pdl=any(ours.pdl for at, ours in table if at == limit))


def this_device() -> str | None:
    """The GPU's name (the key of kernels.wna16.DEVICE_TILES), None without one."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


DEVICE_MIN_GAIN = 0.02  # a device's own tiles must beat the table's by this much in its sweep (its noise)


def _device_kinds(ours, limit: int | None) -> tuple[str, ...]:
    """The kernels a device's own tiles may hold for a class of the table whose entry is `ours`: its kind, and for
    the bf16 classes up to 16 rows the GEMV on tensor cores (wna16_mma), which declines what it cannot take to the
    table's own entry, so the class's kind still serves those calls."""
    if ours.kind in ("gemv_bf16x2", "swap_bf16x2") and limit is not None and limit <= 16:
        return ours.kind, "gemv_mma"
    return (ours.kind,)


def device_tiles(r: dict) -> dict:
    """A sweep's winners as its device's own tiles (its DEVICE_TILES entry): for each class of BLOCKS_BY_M the
    sweep timed, its fastest tiles of the class's kind (or gemv_mma's, _device_kinds) where they ran at least
    DEVICE_MIN_GAIN faster than the class's entry the sweep timed: the device's own tiles where it has them
    (a sweep on that GPU times its table, table_for), else BLOCKS_BY_M's. A class where the table's own tiles
    come out fastest loses the device's entry; one where nothing beat the timed entry by the margin keeps it;
    classes the sweep did not time stay as they were. The classes and kinds stay the table's; where another
    kind won a class, that is printed: a new table, for adopt without --device."""
    from quantship.kernels.wna16 import BLOCKS_BY_M, DEVICE_TILES

    ranking = runnable_ranking(r)
    own = dict(DEVICE_TILES.get(r["device"], {}))
    for limit, shared in BLOCKS_BY_M:
        times = dict(ranking.get(limit, []))
        key = (limit, shared.kind)
        timed = own[key] if own.get(key) in times else shared
        if timed not in times:  # a class the sweep did not time (or not the table's tiles): left as it was
            continue
        theirs = min((b for b in times if b.kind in _device_kinds(shared, limit)), key=times.get)
        if theirs != shared and times[theirs] < (1 - DEVICE_MIN_GAIN) * times[timed]:
            own[key] = class_pdl(theirs, limit, BLOCKS_BY_M)
        elif shared in (theirs, timed):  # the table's own tiles fastest, or the device's not timed: none of its own
            own.pop(key, None)
        first = ranking[limit][0][0]
        if first.kind not in _device_kinds(shared, limit) and shared.kind != "gemv":  # the float32 GEMV: the fallback
            print(f"M={limit}: {_short(first)} ran fastest on the {r['device']}, another kernel than the "
                  f"table's {shared.kind}: not a device's tiles (adopt without --device makes it the table)")
    return own


def device_tiles_source(tiles: dict) -> str:
    """DEVICE_TILES as kernels/wna16.py writes it (devices without tiles of their own left out)."""
    entries = "".join(f"    {json.dumps(name)}: {{\n" + "".join(
        f"        ({limit}, {json.dumps(kind)}): {_source(b)},\n" for (limit, kind), b in own.items()) + "    },\n"
        for name, own in tiles.items() if own)
    return f"{{\n{entries}}}"


def adopt(path: Path, device: bool = False) -> None:
    """Write a sweep's winners into kernels/wna16.py (BLOCKS_BY_M, TINYGEMM_MAX_M): run on the GPU machine
    between the sweep and the engine benchmark, and here with the run's JSON, so both trees hold one table."""
    r = json.loads(path.read_text())
    source = Path(__file__).parent.parent / "src/quantship/kernels/wna16.py"
    text = source.read_text()
    if device:
        from quantship.kernels.wna16 import DEVICE_TILES

        tiles = {**DEVICE_TILES, r["device"]: device_tiles(r)}
        text, count = re.subn(r"DEVICE_TILES: (.*) = \{\n(?:    .*\n)*?\}",
                              lambda m: f"DEVICE_TILES: {m.group(1)} = {device_tiles_source(tiles)}", text)
        assert count == 1, "kernels/wna16.py no longer has DEVICE_TILES where adopt looks for it"
        source.write_text(text)
        print(f"adopted for the {r['device']}:", *(f"M <= {limit} ({kind}): {_source(b)}"
                                                  for (limit, kind), b in tiles[r["device"]].items()), sep="\n  ")
        return
    table, tinygemm_rows = adopted_table(r)
    entries = "".join(f"    ({limit}, {_source(b)}),\n" for limit, b in table)
    text, count = re.subn(r"BLOCKS_BY_M = \[\n(?:    .*\n)*?\]", lambda _: f"BLOCKS_BY_M = [\n{entries}]", text)
    text, count2 = re.subn(r"TINYGEMM_MAX_M = \d+", f"TINYGEMM_MAX_M = {tinygemm_rows}", text)
    assert count == 1 and count2 == 1, "kernels/wna16.py no longer has the table where adopt looks for it"
    source.write_text(text)
    print("adopted:", *(f"M <= {limit}: {_source(b)}" for limit, b in table), f"tinygemm up to {tinygemm_rows} rows",
          sep="\n  ")


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--kinds", nargs="+", default=(), help="sweep only these kernels (and each M's table entry), on "
                   "the layer's four calls: a quick look at one kernel (kernel names, or tma, paired, stream: "
                   "swap_bf16x2 loading through TMA, taking x in the pair order, walking equal runs of K tiles)")
    p.add_argument("--ms", type=int, nargs="+", default=MS, help="rows of x to time (default: all)")
    p.add_argument("--name", default="kernel_wna16", help="the result file's name (NAME.json)")
    p.add_argument("--words", choices=["k", "n"], default="n",
                   help="the packed words held along N (the default, kernels.wna16.WORDS_ALONG_K) or along K")
    p.add_argument("--quads", action="store_true",
                   help="the bf16x2 GEMV adding its K split's sums four per vector reduction where its tiles allow, "
                        "not one atomic per sum (kernels.wna16.GEMV_QUADS)")
    w = sub.add_parser("words", help="the table's kernels with the words held along K and along N")
    w.add_argument("--out", type=Path, default=RESULTS)
    w.add_argument("--ms", type=int, nargs="+", default=list(WORDS_MS))
    a = sub.add_parser("adopt")
    a.add_argument("result", type=Path, help="kernel_wna16.json of a --sweep run")
    a.add_argument("--device", action="store_true", help="as the swept GPU's own tiles (kernels.wna16.DEVICE_TILES) "
                   "where they differ from the table, not as the table every GPU takes")
    sub.add_parser("render")
    args = parser.parse_args()
    if args.cmd == "run":
        from quantship.kernels import wna16

        wna16.WORDS_ALONG_K = args.words == "k"
        wna16.GEMV_QUADS = args.quads
        run(args.out, args.sweep, tuple(args.kinds), tuple(args.ms), args.name)
    elif args.cmd == "words":
        words(args.out, tuple(args.ms))
    elif args.cmd == "adopt":
        adopt(args.result, args.device)
    else:
        render()


if __name__ == "__main__":
    main()
