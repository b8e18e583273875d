"""CPU: the one-row W4A16 GEMV's instructions per packed word, as ptxas compiles it for Hopper (sm_90), and the
tensor-core GEMV's (kernels.wna16_mma) for 1-8 and 9-16 rows of x.

No GPU needed: Triton's compiler and the ptxas and cuobjdump its wheel carries run here. Each one-row tile
the table holds (kernels.wna16: the shared table's and every GPU's own) is compiled as launched for a 6.7B
decoder layer's four calls (int4, groups of 128, bf16 x, programmatic dependent launch on, the down
projection taking SwiGLU's product as its input), and the SASS a program runs once is counted: the code
outside loops (the K loop never runs, since each program takes one K tile), the branch that finishes a
tile's K split included. Divided by the packed words a thread multiplies, that is the issue cost of a
word; times the layer's 25.2 million words it gives the warp instructions of a layer, and at 4 per cycle
on each of 132 multiprocessors at 1.98 GHz (H100 SXM and H200 alike) the least time issuing them can take.
Against the layer's time a GPU sweep measured for the same tile (benchmarks/results), that says how far the
one-row GEMV is from being bound by issuing instructions rather than by memory.

    python benchmarks/kernel_instructions.py run --out benchmarks/results
    python benchmarks/kernel_instructions.py render benchmarks/results/kernel_instructions.json
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _report import RESULTS, registered, run_or_render, table, update_section, write_run  # noqa: E402

LAYER = {"fused qkv": (12288, 4096), "o_proj": (4096, 4096), "gate+up": (22016, 4096), "down": (4096, 11008)}
GROUP = 128
MULTIPROCESSORS, ISSUE_PER_CYCLE, CLOCK_HZ = 132, 4, 1.98e9  # H100 SXM and H200: 4 schedulers, boost clock
# A GPU sweep's file for each GPU whose one-row tile it timed (the layer's four calls summed): the H200's from stop 44,
# the last sweep one had (the GEMV's code has changed little since: its per-layer time in the engine's stop-49 profile
# was 45 µs), the H100's from stop 54 (its tile gemv_mma since; its bf16x2 GEMV's, stop 52: kernel_wna16_narrow_h100).
MEASURED = {"NVIDIA H100 80GB HBM3": "kernel_wna16_mma_h100_m1.json", "NVIDIA H200": "kernel_wna16_h200_sweep.json"}
MMA_MEASURED = "kernel_wna16_mma_h100.json"  # gemv_mma's sweep of both its row ranges in the same tiles (stop 53, H100)
SIGNATURE = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16", "y_ptr": "*bf16",
             "ws_ptr": "*fp32", "counter_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32",
             "stride_wk": "i32", "stride_wn": "i32", "group_size": "i32", "k_per_split": "i32"}
ALIGNED = ("x_ptr", "w_ptr", "s_ptr", "y_ptr", "ws_ptr", "counter_ptr", "N", "K", "stride_xm", "stride_wk",
           "k_per_split")  # as launched: Triton specializes the arguments divisible by 16 (and stride_wn, 1)


def tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def sass_once(cubin: bytes) -> list[str]:
    """The opcodes of the instructions outside loops (a loop: the span from a backward branch's target to it)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        sass = subprocess.run([tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        Path(f.name).unlink()
    code = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]\s+)?([A-Z0-9_.]+)(.*?);", line)
        if m:
            code.append((int(m.group(1), 16), m.group(2).split(".")[0], m.group(3)))
    loops = []
    for address, op, operands in code:
        target = re.search(r"0x([0-9a-f]+)", operands) if op == "BRA" else None
        if target and int(target.group(1), 16) < address:
            loops.append((int(target.group(1), 16), address))
    return [op for address, op, _ in code if not any(lo <= address <= hi for lo, hi in loops) and op != "NOP"]


def compile_call(blocks, gated: bool, rows: int = 1) -> list[str]:
    """The SASS a program of `blocks` runs once, compiled as launched for one of the layer's calls (`gated`: the down
    projection's, SwiGLU's product made as x loads); the bf16x2 GEMV, or gemv_mma's for `rows` rows of x."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from quantship.kernels import _mma_gemv_triton as mma, _wna16_triton as kernels

    if blocks.kind == "gemv_mma":
        fn = mma.wna16_mma_gemv_kernel
        constexprs = dict(HAS_ZERO=False, ATOMIC=True, FINISH=blocks.finish, GATED=gated, EVEN_K=True, EVEN_N=True,
                          REPS=blocks.block_n // 32, GROUP_STEPS=GROUP // 32, STEPS=blocks.block_k // 32,
                          COLS=8 if rows <= 8 else 16, PDL=True, PREFETCH=blocks.num_stages > 1,
                          SCALED=blocks.scaled_values)
        aligned = (*ALIGNED, "product_ptr")
        signature = {name: kind for name, kind in SIGNATURE.items() if name != "stride_wn"}
        signature = dict(list(signature.items())[:7] + [("product_ptr", "*bf16")] + list(signature.items())[7:])
    else:
        fn = kernels.wna16_gemv_bf16x2_kernel
        constexprs = dict(HAS_ZERO=False, ATOMIC=True, FINISH=blocks.finish, SPANS=GROUP % blocks.block_k != 0,
                          GATED=gated, EVEN_K=True, BLOCK_N=blocks.block_n, BLOCK_K=blocks.block_k, PDL=True,
                          QUADS=False, stride_wn=1)
        aligned, signature = ALIGNED, SIGNATURE
    signature = dict(signature, **{name: "constexpr" for name in constexprs})
    src = ASTSource(fn=fn, signature=signature,
                    constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
                    attrs={(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned})
    options = dict(num_warps=blocks.num_warps, launch_pdl=True)
    if blocks.max_registers:
        options["maxnreg"] = blocks.max_registers
    return sass_once(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["cubin"])


def measured(name: str, blocks, m: int = 1) -> tuple[float | None, float | None]:
    """(the layer's four calls in `blocks` at M rows, µs; the copy bandwidth, bytes/s) from the GPU sweep file
    `name` (its ranking for M), or None for what it lacks."""
    path = RESULTS / name
    if not path.exists():
        return None, None
    r = json.loads(path.read_text())
    fields = ("kind", "block_n", "block_k", "split_k", "num_warps", "max_registers", "finish")
    times = [seconds * 1e6 for tile, seconds in r["ranking"].get(str(m), [])
             if all(tile.get(f, 0) == getattr(blocks, f) for f in fields)]
    return (times[0] if times else None), r.get("copy_bandwidth")


def run(args) -> None:
    import triton

    from quantship.kernels import wna16

    tiles = {"the shared table": (wna16.choose_blocks(1), 1)}
    tiles |= {device: (own[(1, "gemv_bf16x2")], 1) for device, own in wna16.DEVICE_TILES.items()
              if (1, "gemv_bf16x2") in own}
    # the GEMV on tensor cores (kernels.wna16_mma) in a tile of each width it was compiled in, for 1-8 and 9-16 rows
    tiles |= {f"gemv_mma, {rows} rows": (wna16.Blocks("gemv_mma", 16, 512, 128, -1, 4, 1), last)
              for rows, last in (("1-8", 8), ("9-16", 16))}
    words = sum(n * k // 8 for n, k in LAYER.values())
    scale_bytes = sum(n * k // GROUP * 2 for n, k in LAYER.values())
    rows = []
    for whose, (blocks, x_rows) in tiles.items():
        threads = 32 * blocks.num_warps
        per_thread = blocks.block_n * blocks.block_k // 8 / threads  # packed words a thread multiplies
        ops = {gated: Counter(compile_call(blocks, gated, x_rows)) for gated in (False, True)}
        # the down projection is the gated call; the other three take x as it is
        layer_words = {gated: sum(n * k // 8 for name, (n, k) in LAYER.items() if (name == "down") == gated)
                       for gated in (False, True)}
        per_word = {gated: sum(ops[gated].values()) / per_thread for gated in (False, True)}
        warp_instructions = sum(layer_words[g] * per_word[g] for g in (False, True)) / 32
        floor_us = warp_instructions / (MULTIPROCESSORS * ISSUE_PER_CYCLE) / CLOCK_HZ * 1e6
        row = {"tiles": whose, "kind": blocks.kind, "rows_of_x": x_rows, "block_n": blocks.block_n,
               "block_k": blocks.block_k, "num_warps": blocks.num_warps, "words_per_thread": per_thread,
               "instructions_per_word": per_word[False], "instructions_per_word_gated": per_word[True],
               "opcodes_per_word": {op: count / per_thread for op, count in ops[False].most_common(8)},
               "layer_warp_instructions": warp_instructions, "issue_floor_us": floor_us}
        sweep = MEASURED.get(whose) or (MMA_MEASURED if blocks.kind == "gemv_mma" else None)
        if sweep:  # gemv_mma: its 1-8 row tile as timed at one row, its 9-16 row tile at 16
            row["measured_us"], bandwidth = measured(sweep, blocks, 1 if x_rows <= 8 else 16)
            row["measured_in"] = sweep
            if bandwidth:  # the words and their bf16 scales, read once at the copy bandwidth
                row["memory_floor_us"] = (words * 4 + scale_bytes) / bandwidth * 1e6
        rows.append(row)
        print(row, flush=True)
    result = {"triton": triton.__version__, "target": "sm_90", "layer_words": words, "multiprocessors": MULTIPROCESSORS,
              "issue_per_cycle": ISSUE_PER_CYCLE, "clock_hz": CLOCK_HZ, "rows": rows}
    write_run(args.out, "kernel_instructions", result)


def render(paths: list[str]) -> None:
    text = ["## The one-row GEMV's instructions per packed word", "",
            "`benchmarks/kernel_instructions.py` (CPU, no GPU): each table's one-row tiles (the bf16x2 GEMV, or "
            "`gemv_mma` where it is a GPU's own) and "
            "the GEMV on tensor cores (`gemv_mma`, for 1-8 rows and for 9-16) compiled for sm_90 as launched for a "
            "6.7B layer's four calls, the SASS a program runs once (outside loops, the finishing branch "
            "included) over the packed words (8 int4 values) each thread multiplies. The issue floor is the "
            "layer's warp instructions at 4 a cycle on 132 multiprocessors at 1.98 GHz; measured is a GPU sweep's "
            "time for the same tiles (the file registered for that GPU), so floor / measured is the share of "
            "the layer's time the schedulers would be busy if each issued one instruction every cycle. The memory "
            "floor is the layer's packed words and scales at the copy bandwidth that sweep measured."]
    for r in registered(paths):
        rows = []
        for row in r["rows"]:
            measured = row.get("measured_us")
            top = ", ".join(f"{op} {n:.1f}" for op, n in list(row["opcodes_per_word"].items())[:5])
            memory = row.get("memory_floor_us")
            rows.append([row["tiles"], f"{row['block_n']} x {row['block_k']}, {row['num_warps']} warps",
                         f"{row['words_per_thread']:.0f}", f"{row['instructions_per_word']:.1f}",
                         f"{row['instructions_per_word_gated']:.1f}", top, f"{row['issue_floor_us']:.1f}",
                         f"{memory:.1f}" if memory else "-",
                         f"{measured:.1f} (`{row['measured_in']}`)" if measured else "-",
                         f"{row['issue_floor_us'] / measured:.0%}" if measured else "-"])
        text += ["", f"Triton {r['triton']}, {r['target']}; a layer's {r['layer_words'] / 1e6:.1f} million packed words", "",
                 table(["tiles of", "outputs, inputs a program", "words a thread", "instructions a word",
                        "the gated call's", "most frequent a word", "issue floor µs a layer",
                        "memory floor µs a layer", "measured µs a layer", "issue floor / measured"], rows)]
    update_section("kernel_instructions", "\n".join(text))


def _run_arguments(p) -> None:
    p.add_argument("--out", default=str(RESULTS), help="folder for kernel_instructions.json")


if __name__ == "__main__":
    run_or_render(__doc__, _run_arguments, run, render)
