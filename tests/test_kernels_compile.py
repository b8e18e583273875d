"""Every Triton kernel compiles for Hopper (sm_90) without a GPU: Triton's own compiler and ptxas run
on the CPU, so CI catches what the interpreter lets through (non-constexpr globals, unsupported ops,
shared memory beyond the chip) before a GPU run does."""

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("triton")

COMPILE = r"""
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from quantship.kernels import _elementwise_triton as elementwise, _fused_moe_triton as moe
from quantship.kernels import _paged_attention_triton as attention, _routing_triton as routing
from quantship.kernels import _wna16_triton as wna16, _mma_gemv_triton as mma_gemv
from quantship.kernels import PLAIN_ROUNDING

def compile(fn, signature, constexprs, before_wait=None, attrs=None, options=None):
    # Kernels that take programmatic dependent launch compile as the GPU launches them: with it on; the
    # GEMVs and the dequantize pass load weights before they wait for the kernel before, the swap tiles
    # prefetch them into L2 (before_wait: what the PTX must show ahead of the wait).
    pdl = "PDL" in fn.arg_names
    constexprs = dict(constexprs, PDL=True) if pdl else constexprs
    signature = dict(signature, **{name: "constexpr" for name in constexprs})
    src = ASTSource(fn=fn, signature=signature,
                    constexprs={(fn.arg_names.index(name),): value for name, value in constexprs.items()},
                    attrs={(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in attrs or ()})
    # The kernels that rotate (rope) launch with PLAIN_ROUNDING: no bf16 FMA may stand for torch's product
    # and subtraction, each rounded.
    rotates = constexprs.get("ROTATE", fn.__name__ in ("rope_kernel", "kv_write_kernel", "latent_write_kernel"))
    options = dict(PLAIN_ROUNDING if rotates else {}, launch_pdl=pdl, **(options or {}))
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    assert kernel.metadata.shared <= 227 * 1024, (fn.__name__, kernel.metadata.shared)
    ptx = kernel.asm["ptx"]
    assert not rotates or "fma.rn.bf16" not in ptx, fn.__name__
    assert ("griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx) == pdl, fn.__name__
    if before_wait:
        assert ptx.index(before_wait) < ptx.index("griddepcontrol.wait"), (fn.__name__, before_wait)
    print(fn.__name__, "ok")
    return kernel

matmul = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*i8", "y_ptr": "*bf16", "ws_ptr": "*fp32",
          "counter_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wk": "i32",
          "stride_wn": "i32", "group_size": "i32", "k_per_split": "i32"}
for bits in (4, 8):
    for zero in (False, True):
        # K split finished in the kernel with zero points, added into a float32 y without (both paths compile)
        tiles = {"BITS": bits, "HAS_ZERO": zero, "ATOMIC": True, "FINISH": zero, "BLOCK_N": 128, "BLOCK_K": 128}
        for spans in (False, True):
            # the GEMVs also compile taking SwiGLU's product of gate and up as their x (GATED)
            compile(wna16.wna16_gemv_kernel, matmul, dict(tiles, SPANS=spans, GATED=spans, EVEN_K=spans),
                    before_wait="ld.global")
            if bits == 4:  # its bf16x2 PTX goes through ptxas here: the interpreter cannot run it
                for gated in (False, True):
                    compile(wna16.wna16_gemv_bf16x2_kernel, matmul,
                            {k: v for k, v in dict(tiles, SPANS=spans, GATED=gated, EVEN_K=gated, QUADS=False).items()
                             if k != "BITS"}, before_wait="ld.global")
            for block_m, block_n in ((16, 128), (64, 64)):  # the table's two swap tiles
                # the 64-row ones also with the grid walking row blocks first (prefill candidates)
                compile(wna16.wna16_swap_dot_kernel, matmul,
                        dict(tiles, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=16 * 32 // bits, SPANS=spans,
                             EVEN_K=spans, ROWS_FIRST=block_m == 64), before_wait="prefetch.global.L2")
                compile(wna16.wna16_swap_x_kernel, matmul,
                        dict(tiles, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=16 * 32 // bits, SPANS=spans,
                             EVEN_K=spans, ROWS_FIRST=block_m == 64), before_wait="prefetch.global.L2")
        if bits == 4:  # the GEMV on tensor cores (wna16_mma): its inline PTX takes a thread's 4 elements of each
            # operand as one lane's fragment of a warp's product, so every operand must be laid out 4 registers a
            # thread along the last axis, lane i % 32 of warp i // 32 along the middle one, and none converted
            mma = {k: v for k, v in matmul.items() if k != "stride_wn"}
            mma = {**{k: v for k, v in mma.items() if k in ("x_ptr", "w_ptr", "s_ptr", "z_ptr", "y_ptr", "ws_ptr",
                                                                "counter_ptr")}, "product_ptr": "*bf16",
                   **{k: v for k, v in mma.items() if k in ("M", "N", "K", "stride_xm", "stride_wk", "group_size",
                                                                "k_per_split")}}
            for gated in (False, True):
                ttgir = compile(mma_gemv.wna16_mma_gemv_kernel, mma,
                                dict(HAS_ZERO=zero, ATOMIC=True, FINISH=not zero, GATED=gated, EVEN_K=not gated, EVEN_N=gated,
                                     REPS=16, GROUP_STEPS=4, STEPS=8, COLS=16 if gated else 8, PREFETCH=gated,
                                     SCALED=zero),  # values scaled before their products: with zero points
                                before_wait="ld.global",
                                attrs=("x_ptr", "w_ptr", "s_ptr", "y_ptr", "ws_ptr", "counter_ptr", "product_ptr",
                                       "N", "K", "stride_xm", "stride_wk", "k_per_split")).asm["ttgir"]
                layouts = dict(re.findall(r"^(#\w+) = (.*)$", ttgir, re.M))
                used = {name for line in ttgir.splitlines() if "elementwise_inline_asm" in line
                        for name in re.findall(r"(#blocked\d*)>", line)}
                lanes = "sizePerThread = [1, 1, 4], threadsPerWarp = [1, 32, 1], warpsPerCTA = [1, 4, 1]"
                assert used and all(lanes in layouts[name] for name in used), [layouts[name] for name in used]
                assert "convert_layout" not in ttgir
        if bits == 4:  # one product per K tile, its values two per instruction (bf16x2 PTX); as launched (the
            # sizes divisible by 16), the inline asm must run on the product's operand registers, not in a layout
            # converted through shared memory after it
            for block_m, block_k, even in ((16, 256, True), (64, 128, False)):
                kernel = compile(wna16.wna16_swap_bf16x2_kernel, matmul,
                                 {k: v for k, v in dict(tiles, BLOCK_M=block_m, BLOCK_K=block_k, EVEN_K=even,
                                                        ROWS_FIRST=False, ASM=True, X_PAIRED=False).items() if k != "BITS"},
                                 before_wait="prefetch.global.L2", attrs=("N", "K", "stride_xm", "k_per_split"))
                asm = [line for line in kernel.asm["ttgir"].splitlines() if "elementwise_inline_asm" in line and "lop3" in line]
                assert len(asm) == 1 and "-> tensor<128x%dxbf16, #ttg.dot_op<{opIdx = 0" % block_k in asm[0], asm
                # x permuted per tile is stored from registers to shared memory for the product; x copied to the
                # pair order first (X_PAIRED) goes from memory to the product as loaded: nothing stored from registers
                stored = lambda k: len(re.findall(r"ttg.local_alloc %", k.asm["ttgir"]))  # noqa: E731
                paired = compile(wna16.wna16_swap_bf16x2_kernel, matmul,
                                 {k: v for k, v in dict(tiles, BLOCK_M=block_m, BLOCK_K=block_k, EVEN_K=even,
                                                        ROWS_FIRST=False, ASM=True, X_PAIRED=True).items() if k != "BITS"},
                                 attrs=("x_ptr", "w_ptr", "N", "K", "stride_xm", "k_per_split"))  # as launched
                assert stored(kernel) == 1 and stored(paired) == 0, (stored(kernel), stored(paired))
        # Words held along K (stride_wk 1, as wna16.hold lays them out) load as 16-byte vectors in whole tiles,
        # the GEMV's straight into registers, the tiles' into shared memory
        along_k = dict(matmul, stride_wk="constexpr")
        for fn, extra, vector in ((wna16.wna16_gemv_kernel, dict(SPANS=False, GATED=False), ".v4.b32"),
                                  (wna16.wna16_swap_x_kernel, dict(BLOCK_M=16, BLOCK_K=16 * 32 // bits, SPANS=False,
                                                                   ROWS_FIRST=False), "], 0x10"),
                                  (wna16.wna16_swap_bf16x2_kernel,
                                   dict(BLOCK_M=16, ROWS_FIRST=False, ASM=True, X_PAIRED=False), "], 0x10")):
            if fn is wna16.wna16_swap_bf16x2_kernel and bits == 8:
                continue
            tile = {k: v for k, v in dict(tiles, EVEN_K=True, **extra).items() if k in fn.arg_names}
            aligned = ("x_ptr", "w_ptr", "s_ptr", "y_ptr", "ws_ptr", "counter_ptr", "N", "K", "stride_xm", "k_per_split")
            ptx = compile(fn, along_k, dict(tile, stride_wk=1), attrs=aligned + ("stride_wn",)).asm["ptx"]
            words = [line for line in ptx.splitlines() if "cp.async" in line or "ld.global" in line]
            assert any(vector in line for line in words), (fn.__name__, words[:8])
            if fn is wna16.wna16_swap_bf16x2_kernel:
                # a register cap (Blocks.max_registers) reaches ptxas
                capped = compile(fn, along_k, dict(tile, stride_wk=1), attrs=aligned + ("stride_wn",),
                                 options={"maxnreg": 128})
                assert ".maxnreg 128" in capped.asm["ptx"]
                # along N (the layout held, as launched: stride 1 specialized) the pairs are still made on the
                # product's operand registers
                ttgir = compile(fn, dict(matmul, stride_wn="constexpr"), dict(tile, stride_wn=1),
                                attrs=aligned + ("stride_wk",)).asm["ttgir"]
                asm = [line for line in ttgir.splitlines() if "elementwise_inline_asm" in line and "lop3" in line]
                assert len(asm) == 1 and "#ttg.dot_op<{opIdx = 0" in asm[0], asm
        compile(wna16.dequantize_kernel, {"w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*i8", "out_ptr": "*bf16",
                "N": "i32", "K": "i32", "stride_wk": "i32", "stride_wn": "i32", "group_size": "i32"},
                {"BITS": bits, "HAS_ZERO": zero, "BLOCK_N": 128, "BLOCK_K": 128}, before_wait="ld.global")
# The table's swap_bf16x2 tiles (every GPU's) as launched, for bf16 x and float32 x (a float32 model on a GPU
# stages twice the bytes of x; matmul takes the depth wna16.swap_depth gives): each within the multiprocessor's
# shared memory, through TMA where the tile asks for it and through pointers (where TMA cannot read the tensors).
# The table's 128-row tile 128 deep did not fit with float32 x once.
from quantship.kernels.wna16 import BLOCKS_BY_M, DEVICE_TILES, swap_depth
tiles = {b for b in [b for _, b in BLOCKS_BY_M] + [b for own in DEVICE_TILES.values() for b in own.values()]
         if b.kind == "swap_bf16x2"}
print("table tiles", len(tiles), "through tma", sum(b.tma for b in tiles))
for b in tiles:
    for x_type, x_bytes in (("bf16", 2), ("fp32", 4)):
        depth = swap_depth(b, b.block_k, x_bytes)
        tile = dict(HAS_ZERO=False, ATOMIC=True, FINISH=b.finish, BLOCK_M=b.block_m, BLOCK_N=b.block_n, BLOCK_K=depth,
                    ROWS_FIRST=b.rows_first, ASM=x_type == "bf16", X_PAIRED=b.x_paired)
        options = {"num_warps": b.num_warps, "num_stages": b.num_stages}
        compile(wna16.wna16_swap_bf16x2_kernel, dict(matmul, x_ptr="*" + x_type, s_ptr="*" + x_type, y_ptr="*" + x_type),
                dict(tile, EVEN_K=True), attrs=("x_ptr", "w_ptr", "N", "K", "stride_xm", "k_per_split"), options=options)
        if b.tma:
            descriptors = {"x_desc": f"tensordesc<{x_type}[{b.block_m}, {depth}]>",
                           "w_desc": f"tensordesc<i32[{depth // 8}, {b.block_n}]>"}
            pointers = {k: v for k, v in matmul.items() if k not in ("x_ptr", "w_ptr", "stride_xm", "stride_wk", "stride_wn")}
            kernel = compile(wna16.wna16_swap_bf16x2_tma_kernel,
                             dict(descriptors, **dict(pointers, s_ptr="*" + x_type, y_ptr="*" + x_type)), tile,
                             attrs=("N", "K", "k_per_split"), options=options)
            # the tiles come by TMA copies alone, and for bf16 x the pairs are made on the product's operand registers
            assert "cp.async.bulk.tensor" in kernel.asm["ptx"] and "cp.async.cg" not in kernel.asm["ptx"]
            asm = [line for line in kernel.asm["ttgir"].splitlines() if "elementwise_inline_asm" in line and "lop3" in line]
            assert x_type == "fp32" or (len(asm) == 1 and "#ttg.dot_op<{opIdx = 0" in asm[0]), asm
# The bf16x2 GEMV with its K split's sums added four per vector reduction (QUADS, as wna16._quads allows: whole quads
# a thread): one reduction per 4 outputs and per thread, so no output is added twice, and no scalar atomics left.
for block_n, block_k, warps, gated in ((512, 64, 4, False), (512, 128, 4, True), (1024, 64, 4, False),
                                       (256, 128, 2, False)):
    kernel = compile(wna16.wna16_gemv_bf16x2_kernel, matmul,
                     dict(HAS_ZERO=False, ATOMIC=True, FINISH=True, BLOCK_N=block_n, BLOCK_K=block_k, SPANS=False,
                          GATED=gated, EVEN_K=True, QUADS=True), before_wait="ld.global", options={"num_warps": warps})
    ptx = kernel.asm["ptx"]
    assert ptx.count("red.relaxed.gpu.global.add.v4.f32") == block_n // (4 * 32 * warps), (block_n, warps)
    assert not re.search(r"(atom|red)\.global\.gpu\.relaxed\.add\.f32", ptx), block_n
# The stream kernel (Blocks.stream): its loop stays pipelined, the copies of later K tiles issued before the
# product of this one (a barrier in the loop, as the workspace's counter takes, would leave one buffer, each copy
# waited for as it is issued), and for bf16 x the pairs are made on the product's operand registers.
for rows, warps, paired in ((16, 4, False), (64, 8, True)):
    for x_type in ("bf16", "fp32"):
        descriptors = {"x_desc": f"tensordesc<{x_type}[{rows}, 128]>", "w_desc": "tensordesc<i32[16, 128]>"}
        pointers = {k: v for k, v in matmul.items() if k not in ("x_ptr", "w_ptr", "stride_xm", "stride_wk", "stride_wn",
                                                                "k_per_split")}
        # under PDL the raw words too, for the prefetch of the run's first K tiles (PREFETCH) before the wait
        words = {"steps_per_program": "i32", "w_ptr": "*i32", "stride_wk": "i32", "stride_wn": "i32"}
        kernel = compile(wna16.wna16_swap_bf16x2_stream_kernel,
                         dict(descriptors, **dict(pointers, s_ptr="*" + x_type, y_ptr="*" + x_type), **words),
                         dict(HAS_ZERO=paired, FINISH=True, BLOCK_M=rows, BLOCK_N=128, BLOCK_K=128, ASM=x_type == "bf16",
                              X_PAIRED=paired, PREFETCH=1 if paired else 4), before_wait="prefetch.global.L2",
                         attrs=("N", "K"),
                         options={"num_warps": warps, "num_stages": 3})
        # one prefetch per word of the PREFETCH K tiles [16 word rows, 128] before the wait, spread over the threads
        ptx = kernel.asm["ptx"]
        ahead = ptx[:ptx.index("griddepcontrol.wait")].count("prefetch.global.L2")
        assert ahead == (1 if paired else 4) * 16 * 128 // (32 * warps), ahead
        buffers = [re.findall(rf"ttg.local_alloc : \(\) -> !ttg.memdesc<(\d+)x{shape}", kernel.asm["ttgir"])
                   for shape in (f"{rows}x128x{x_type.replace('fp', 'f')}", "16x128xi32")]  # x's tiles, the words'
        assert all(len(b) == 1 and int(b[0]) >= 2 for b in buffers), buffers
        asm = [line for line in kernel.asm["ttgir"].splitlines() if "elementwise_inline_asm" in line and "lop3" in line]
        assert x_type == "fp32" or (len(asm) == 1 and "#ttg.dot_op<{opIdx = 0" in asm[0]), asm
experts = {"w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*i8"}
gate_up = {"x_ptr": "*bf16", **{p.replace("w_", "gate_").replace("s_", "gate_s_").replace("z_", "gate_z_"): t
           for p, t in experts.items()}, **{p.replace("w_", "up_").replace("s_", "up_s_").replace("z_", "up_z_"): t
           for p, t in experts.items()}, "act_ptr": "*bf16", "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32",
           "ws_ptr": "*fp32", "counter_ptr": "*i32", "num_slots": "i32", "expert_begin": "i32", "num_experts": "i32",
           "H": "i32", "I": "i32", "TOP_K": "i32", "group_size": "i32", "k_per_split": "i32"}
down = {"act_ptr": "*bf16", **experts, "out_ptr": "*bf16", "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32",
        "routing_ptr": "*fp32", "ws_ptr": "*fp32", "counter_ptr": "*i32", "num_slots": "i32", "expert_begin": "i32",
        "num_experts": "i32", "H": "i32", "I": "i32", "group_size": "i32", "k_per_split": "i32"}
for bits, zero in ((0, False), (4, False), (4, True), (8, False)):
    weight_type = "*bf16" if bits == 0 else "*i32"
    for spans, block_m in ((False, 16), (True, 16), (False, 64), (True, 64)) if bits else ((False, 16), (False, 64)):
        # decode blocks compile with their K split finished in the kernel, prefill blocks without
        tiles = {"BITS": bits, "HAS_ZERO": zero, "SPANS": spans, "SPLIT": block_m == 16, "BLOCK_M": block_m,
                 "BLOCK_N": 64, "BLOCK_K": 128 if bits == 4 and block_m == 16 else 64, "KN": False}
        # prefill blocks of bf16 experts also read packed experts dequantized once ([E, K, N]: KN)
        for kn in (False, True) if bits == 0 and block_m == 64 else (False,):
            compile(moe.moe_gate_up_kernel, dict(gate_up, gate_ptr=weight_type, up_ptr=weight_type),
                    dict(tiles, KN=kn))
            compile(moe.moe_down_kernel, dict(down, w_ptr=weight_type), dict(tiles, KN=kn))
gemv_gate_up = {k: v for k, v in gate_up.items()
                if k not in ("sorted_ids_ptr", "block_expert_ptr", "expert_begin", "num_experts")}
gemv_gate_up = dict(list(gemv_gate_up.items())[:7] + [("indices_ptr", "*i64")] + list(gemv_gate_up.items())[7:])
gemv_down = {"act_ptr": "*bf16", **experts, "out_ptr": "*bf16", "indices_ptr": "*i64", "routing_ptr": "*fp32",
             "ws_ptr": "*fp32", "counter_ptr": "*i32", "H": "i32", "I": "i32", "TOP_K": "i32",
             "group_size": "i32", "k_per_split": "i32"}
for bits, zero, spans in ((4, False, False), (4, True, True), (8, False, False)):  # the slot GEMV, split and not
    for split in (False, True):
        # int4 slots also compile with their values in bf16x2 pairs (PTX the interpreter cannot run)
        for bf16x2 in (False, True) if bits == 4 else (False,):
            tiles = {"BITS": bits, "HAS_ZERO": zero, "SPANS": spans, "SPLIT": split, "BF16X2": bf16x2,
                     "BLOCK_N": 256, "BLOCK_K": 128 if bf16x2 else 64}
            compile(moe.moe_gemv_gate_up_kernel, gemv_gate_up, tiles)
            compile(moe.moe_gemv_down_kernel, gemv_down, tiles)
for method, sigmoid, groups, group_block, k_block in ((0, False, 1, 64, 8), (1, False, 8, 32, 8), (2, True, 8, 32, 8)):
    compile(routing.route_kernel, {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "weights_ptr": "*fp32",
            "indices_ptr": "*i64", "E": "i32", "GROUP_SIZE": "i32", "TOP_K": "i32", "TOPK_GROUP": "i32",
            "scaling": "fp32", "SHARED": "i32"}, {"SIGMOID": sigmoid, "METHOD": method, "NORMALIZE": sigmoid, "HAS_BIAS": sigmoid,
            "GROUPS": groups, "GROUP_BLOCK": group_block, "K_BLOCK": k_block})
for experts, chunk in ((64, 64), (256, 16)):  # V2-Lite's and V3's routed experts
    compile(moe.align_kernel, {"indices_ptr": "*i64", "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32",
            "num_slots": "i32", "num_experts": "i32", "capacity": "i32"},
            {"BLOCK_M": 16, "EXPERTS": experts, "CHUNK": chunk})
split = {"part_ptr": "*fp32", "stats_ptr": "*fp32"}
gqa = dict({"q_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "cache_ptr": "*bf16", "slots_ptr": "*i64",
            "lengths_ptr": "*i32", "out_ptr": "*bf16"}, **split,
           **{name: "i32" for name in ("stride_qs", "stride_qh", "stride_cos", "stride_slots", "width")},
           scale="fp32", keys_per_split="i32")
for group, dim in ((1, 128), (4, 128), (7, 64)):
    for splits, rotate in ((False, False), (True, False), (False, True), (True, True)):
        compile(attention.paged_decode_kernel, gqa,
                {"GROUP": group, "KV_HEADS": 8, "HEAD_DIM": dim, "BLOCK_H": 16, "BLOCK_HALF": dim // 2, "BLOCK_N": 64,
                 "SPLIT": splits, "ROTATE": rotate, "INTERLEAVED": False})
mla = dict({"q_ptr": "*bf16", "qr_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "cache_ptr": "*bf16",
            "slots_ptr": "*i64", "lengths_ptr": "*i32", "out_ptr": "*bf16"}, **split,
           **{name: "i32" for name in ("stride_qs", "stride_qh", "stride_rs", "stride_rh", "stride_cos", "stride_slots",
                                       "width", "heads")}, scale="fp32", keys_per_split="i32")
for rank, rope, block_n in ((512, 64, 32), (128, 16, 64)):  # DeepSeek-V2/V3's latent, the bundled model's
    for splits, rotate in ((False, False), (True, False), (False, True), (True, True)):
        compile(attention.paged_mla_decode_kernel, mla,
                {"RANK": rank, "HALF": rope // 2, "BLOCK_R": rank, "BLOCK_HALF": max(16, rope // 2), "BLOCK_H": 16,
                 "BLOCK_N": block_n, "SPLIT": splits, "ROTATE": rotate, "INTERLEAVED": True})
    compile(attention.combine_splits_kernel, dict(split, out_ptr="*bf16", splits="i32"),
            {"D": rank, "BLOCK_S": 16, "BLOCK_D": rank})
for block in (512, 4096, 8192):  # the bundled model's hidden size up to DeepSeek-V3's 7168
    compile(elementwise.rms_norm_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "stride_x": "i32",
            "n": "i32", "eps": "fp32"}, {"BLOCK": block})
compile(elementwise.add_rms_norm_kernel, {"x_ptr": "*bf16", "d_ptr": "*bf16", "w_ptr": "*bf16", "sum_ptr": "*bf16",
        "out_ptr": "*bf16", "stride_x": "i32", "stride_d": "i32", "n": "i32", "eps": "fp32"}, {"BLOCK": 8192})
for kv_heads, dim in ((32, 128), (2, 64)):  # DeepSeek-Coder-6.7B: 32 K/V heads of 128; a GQA model
    compile(elementwise.kv_write_kernel, {"k_ptr": "*bf16", "v_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16",
            "kv_ptr": "*bf16", "slots_ptr": "*i64", "stride_kt": "i32", "stride_kh": "i32", "stride_v": "i32",
            "stride_cos": "i32", "width": "i32"},
            {"KV_HEADS": kv_heads, "HALF": dim // 2, "INTERLEAVED": False, "BLOCK_P": dim // 2, "BLOCK_D": dim})
compile(elementwise.silu_mul_kernel, {"g_ptr": "*bf16", "u_ptr": "*bf16", "out_ptr": "*bf16", "n": "i32",
        "stride_g": "i32", "stride_u": "i32"}, {"BLOCK": 1024})
for rank, half in ((512, 32), (128, 8)):  # DeepSeek-V2/V3's latent and rope key, the bundled model's
    compile(elementwise.latent_write_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16",
            "kv_ptr": "*bf16", "slots_ptr": "*i64", "stride_x": "i32", "stride_cos": "i32", "width": "i32",
            "eps": "fp32"}, {"RANK": rank, "HALF": half, "INTERLEAVED": True, "BLOCK_R": rank, "BLOCK_P": half})
for interleaved, block in ((True, 32), (False, 64)):  # DeepSeek's 64 rope dims in pairs, Llama's 128 in halves
    compile(elementwise.rope_kernel, {"x_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "out_ptr": "*bf16",
            "half": "i32", "stride_a": "i32", "stride_t": "i32", "stride_cos": "i32", "out_stride_a": "i32",
            "out_stride_t": "i32"},
            {"INTERLEAVED": interleaved, "BLOCK": block})
"""


def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    tiles, tma = map(int, re.search(r"table tiles (\d+) through tma (\d+)", done.stdout).groups())
    assert tiles >= 4 and done.stdout.count(" ok") == 174 + 2 * (tiles + tma)


def test_dependent_launch_is_asked_for_and_only_on_a_gpu(monkeypatch):
    """PDL only where asked (by default, or QUANTSHIP_PDL=1) and the tensor is on a GPU: the interpreter
    cannot run the wait (a CPU tensor under TRITON_INTERPRET must get PDL off even when asked)."""
    import torch

    from quantship.kernels import dependent_launch

    off = {"PDL": False}
    monkeypatch.delenv("QUANTSHIP_PDL", raising=False)  # the default, asked for every kernel but the tiles
    assert dependent_launch(torch.zeros(1)) == off
    monkeypatch.setenv("QUANTSHIP_PDL", "1")
    assert dependent_launch(torch.zeros(1)) == off
    if torch.cuda.is_available():
        on = torch.cuda.get_device_capability()[0] >= 9
        assert dependent_launch(torch.zeros(1, device="cuda")) == ({"PDL": True, "launch_pdl": True} if on else off)
        monkeypatch.setenv("QUANTSHIP_PDL", "0")
        assert dependent_launch(torch.zeros(1, device="cuda")) == off


@pytest.mark.parametrize("setting, kernels, tiles", [(None, True, False), ("", True, False), ("1", True, True),
                                                     ("0", False, False)])
def test_pdl_settings_say_which_kernels(monkeypatch, setting, kernels, tiles):
    """PDL by default for every kernel but those default_off (the swap tiles but the stream-K ones of a class whose
    Blocks.pdl is on, the MoE path's); QUANTSHIP_PDL=1 for every kernel, =0 for none."""
    from quantship.kernels import pdl_asked

    if setting is None:
        monkeypatch.delenv("QUANTSHIP_PDL", raising=False)
    else:
        monkeypatch.setenv("QUANTSHIP_PDL", setting)
    assert pdl_asked() == kernels and pdl_asked(default_off=True) == tiles
