"""GPU kernels (Triton), each beside the plain-torch function it must equal.

Nothing here imports the rest of quantship. Triton is imported only when a kernel is launched:
on a machine without CUDA (and without TRITON_INTERPRET=1) the reference functions are the path.
"""
