"""GPU kernels (Triton), each beside the plain-torch function it must equal.

Nothing here imports the rest of quantship. Triton is imported only when a kernel is launched:
on a machine without CUDA (and without TRITON_INTERPRET=1) the reference functions are the path.
"""

import os

import torch

# Triton's dot and our float32 accumulators take these; float64 (used by exactness tests) stays on the
# plain-torch references.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def on_gpu_kernel(x: torch.Tensor) -> bool:
    """Whether a tensor goes through the Triton kernels: on CUDA and in a dtype they compile for."""
    return x.is_cuda and x.dtype in KERNEL_DTYPES


# Launch option of the kernels that must round as the plain ops do (the rotary embedding: each product and
# sum rounded to x's dtype): without it the compiler narrows the float32 product of two bf16 numbers to bf16
# and contracts it with the subtraction after into one bf16 FMA, one rounding where torch makes two (the
# PTX of Triton 3.9 for sm_90 shows it; on an H100 the decode kernel rotating its queries then gave up to
# 2^-9 off what it gave for queries the rope kernel rotated).
PLAIN_ROUNDING = {"enable_fp_fusion": False}

_GPUS: dict[int, tuple[int, str]] = {}


def _gpu(x: torch.Tensor) -> tuple[int, str]:
    """(compute capability major, name) of the GPU x is on, asked once per device: launches read them on
    every eager call."""
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if index not in _GPUS:
        _GPUS[index] = (torch.cuda.get_device_capability(index)[0], torch.cuda.get_device_name(index))
    return _GPUS[index]


def capability_major(x: torch.Tensor) -> int:
    """The compute capability's major version of the GPU x is on (9 for Hopper)."""
    return _gpu(x)[0]


def device_name(x: torch.Tensor) -> str | None:
    """The name of the GPU x is on, as torch.cuda.get_device_name gives it ("NVIDIA H200"); None off the GPU."""
    return _gpu(x)[1] if x.is_cuda else None


_SM_COUNTS: dict[torch.device, int] = {}


def sm_count(device: torch.device) -> int:
    """The device's multiprocessors (4 for the CPU under Triton's interpreter: grids sized by it get tested
    there at small sizes too), asked once per device: launches size their grids by it on every eager call."""
    if device not in _SM_COUNTS:
        _SM_COUNTS[device] = torch.cuda.get_device_properties(device).multi_processor_count \
            if device.type == "cuda" else 4
    return _SM_COUNTS[device]


def pdl_asked(default_off: bool = False) -> bool:
    """Whether QUANTSHIP_PDL asks for programmatic dependent launch for a kernel (dependent_launch): 0 for
    none, 1 for every kernel, anything else (unset) for every kernel but those `default_off`."""
    setting = os.environ.get("QUANTSHIP_PDL")
    return setting == "1" or (setting != "0" and not default_off)


def dependent_launch(x: torch.Tensor, default_off: bool = False) -> dict:
    """Launch options of a kernel working on x: programmatic dependent launch (PDL, _pdl_triton.py) on a
    GPU that has it (compute capability 9.0 and later), so inside a decode step's CUDA graph each kernel's
    launch and weight loads overlap the kernel before. By default for every kernel but those `default_off`:
    the W4A16 swap tiles of batch 2-256 (but the stream-K tile up to 16 rows, 9% off the batch-16 step on an
    H100: its class's Blocks.pdl), which made the batch-16 step 6-15% slower with it on an H100 in their
    pointer form and the 64-row step 18% slower, and the dequantize pass and the MoE path's kernels (routing,
    fused experts), not timed with it. The rest (the GEMVs, norms, rotary, cache writes, SwiGLU, paged
    attention) made the W4A16 batch-1 step 10-12%
    faster there and bf16's 1% (`benchmarks/engine_throughput.py quick --pdl`, BENCHMARKS.md), with the
    same greedy tokens. QUANTSHIP_PDL=0 turns it off, =1 on for every kernel. CI checks what each kernel
    compiles to with it."""
    on = x.is_cuda and pdl_asked(default_off) and capability_major(x) >= 9
    # launch_pdl only when on: Triton before 3.3 has no such launch option
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
