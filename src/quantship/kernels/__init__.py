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
# PTX of Triton 3.9 for sm_90 shows it; on an H100 it moved rotated queries by an ulp).
PLAIN_ROUNDING = {"enable_fp_fusion": False}

_DEPENDENT_LAUNCH: dict[int, bool] = {}


def pdl_asked(tile: bool = False) -> bool:
    """Whether QUANTSHIP_PDL asks for programmatic dependent launch for a kernel (dependent_launch)."""
    setting = os.environ.get("QUANTSHIP_PDL")
    return setting == "1" or (setting == "no-tiles" and not tile)


def dependent_launch(x: torch.Tensor, tile: bool = False) -> dict:
    """Launch options of a kernel working on x: programmatic dependent launch (PDL, _pdl_triton.py) where
    QUANTSHIP_PDL asks for it and the GPU has it (compute capability 9.0 and later), so inside a decode
    step's CUDA graph each kernel's launch and weight loads overlap the kernel before. QUANTSHIP_PDL=1: every
    kernel; =no-tiles: all but the W4A16 swap tiles (`tile`, the multi-row kernels of batch 2-64), which
    measured slower with it at batch 16 on an H100 while the GEMVs gained. Off by default until measured on
    a GPU (`benchmarks/engine_throughput.py quick --pdl`); CI checks what it compiles to."""
    on = False
    if x.is_cuda and pdl_asked(tile):
        index = x.device.index if x.device.index is not None else torch.cuda.current_device()
        if index not in _DEPENDENT_LAUNCH:
            _DEPENDENT_LAUNCH[index] = torch.cuda.get_device_capability(index)[0] >= 9
        on = _DEPENDENT_LAUNCH[index]
    # launch_pdl only when on: Triton before 3.3 has no such launch option
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
