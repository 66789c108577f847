"""Programmatic dependent launch (PDL) between the engine's own Triton kernels.

A decode step runs some 300 small kernels, and between two of them the GPU drains the first
before it launches the second, in CUDA graphs too. A kernel launched with
``launch_pdl=dependent_launch(t)`` may be launched while the kernel before it still runs: its
programs start with ``await_inputs``, which waits until that kernel has finished and its
writes are visible (``griddepcontrol.wait``: nothing is read or written before it), then lets
the kernel after it launch in turn (``griddepcontrol.launch_dependents``). What overlaps is the
launch and the programs' set-up, never a read of unfinished output. Kernels launched without
the attribute (cuBLAS, compiled elementwise functions) keep the stream's plain ordering.

Hopper (compute capability 9.0) and later; ``HITCHLLM_PDL=0`` turns it off. The kernels that
use it: the q/k norm + rotary kernel, the split-K projection and add-and-norm kernels, and
TRITON_ATTN's KV write, attention and split merge.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from hitchllm.attention.triton_support import triton_interpreting

ENV = "HITCHLLM_PDL"


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def dependent_launch(t: torch.Tensor) -> bool:
    """The ``launch_pdl`` (and ``PDL``) argument of a kernel on ``t``'s device: an NVIDIA GPU
    (not ROCm's) of compute capability 9.0 or later, Triton compiling rather than
    interpreting, and ``HITCHLLM_PDL`` not ``0``."""
    return (t.is_cuda and torch.version.hip is None and not triton_interpreting()
            and os.environ.get(ENV, "1") != "0" and _capable(t.device.index or 0))


@triton.jit
def await_inputs(PDL: tl.constexpr):
    """A kernel's first statement when launched with ``launch_pdl=PDL``: wait for the kernel
    before it to finish, then let the kernel after it launch. Nothing when ``PDL`` is false."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
