"""GPU kernels (Triton), each beside the plain-torch function it must equal.

Nothing here imports the rest of quantship. Triton is imported only when a kernel is launched:
on a machine without CUDA (and without TRITON_INTERPRET=1) the reference functions are the path.
"""

import torch

# Triton's dot and our float32 accumulators take these; float64 (used by exactness tests) stays on the
# plain-torch references.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def on_gpu_kernel(x: torch.Tensor) -> bool:
    """Whether a tensor goes through the Triton kernels: on CUDA and in a dtype they compile for."""
    return x.is_cuda and x.dtype in KERNEL_DTYPES
