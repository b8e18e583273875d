"""Programmatic dependent launch (PDL, Hopper and later) inside the kernels: kernels.dependent_launch
says when it is on; with the PDL constexpr False both helpers compile to nothing (the interpreter, GPUs
before Hopper, QUANTSHIP_PDL=0, the kernels it leaves out by default).

A kernel launched with PDL may start while the kernel before it in the stream is still running. It may
read what nothing in the step writes (weights, scales) before `wait_for_inputs`, and must read or write
anything else only after it: the wait returns once the kernel before has finished and its writes are
visible, and since every such kernel waits before it finishes, that covers every kernel before it.
`release_dependents` lets the next kernel launch as soon as every program of this one has started; a
decode step's kernels are a few microseconds each, so the next one's start-up (launch, weight loads)
hides behind this one's last programs instead of following them."""

import triton
import triton.language as tl


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def release_dependents(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def start_dependent(PDL: tl.constexpr):
    """A kernel that reads nothing before its inputs: let the next launch, then wait for the one before."""
    release_dependents(PDL)
    wait_for_inputs(PDL)
