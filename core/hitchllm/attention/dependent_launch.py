"""Programmatic dependent launch (PDL) between the engine's own Triton kernels.

A decode step runs some 300 small kernels, and between two of them the GPU drains the first
before it launches the second, in CUDA graphs too. A kernel given ``PDL=pdl`` and launched with
``**launch_options(pdl)`` (``pdl = dependent_launch(t)``) may start while the kernel before it
still runs: its programs begin with ``await_inputs``, which waits until that kernel has
finished and its writes are visible (``griddepcontrol.wait``: nothing is read or written
before it), then lets the kernel after it launch in turn (``griddepcontrol.launch_dependents``).
What overlaps is the launch and the programs' set-up, never a read of unfinished output.
Kernels launched without it (cuBLAS, anything torch.compile built) keep the stream's plain
ordering.

Hopper (compute capability 9.0) and later; ``HITCHLLM_PDL=0`` turns it off. The kernels that
use it: the q/k norm + rotary kernel, the norms and SiLU-and-multiply
(``hitchllm.models.elementwise_kernels``), the split-K projection kernel, and TRITON_ATTN's KV
write, attention and split merge.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from hitchllm.attention.triton_support import triton_interpreting

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # Triton before 3.4: no grid dependency control, every launch plain
    gdc_wait = gdc_launch_dependents = None

ENV = "HITCHLLM_PDL"


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def dependent_launch(t: torch.Tensor) -> bool:
    """The ``PDL`` argument of a kernel on ``t``'s device: an NVIDIA GPU (not ROCm's) of
    compute capability 9.0 or later, a Triton that has grid dependency control, compiling
    rather than interpreting, and ``HITCHLLM_PDL`` not ``0``. A CUDA graph keeps what its
    kernels were captured with."""
    return (gdc_wait is not None and t.is_cuda and torch.version.hip is None
            and not triton_interpreting() and os.environ.get(ENV, "1") != "0"
            and _capable(t.device.index or 0))


def launch_options(pdl: bool) -> dict[str, bool]:
    """The launch keywords of a kernel given ``PDL=pdl``: ``launch_pdl`` only when ``pdl``
    (Triton's AMD backend and Triton before 3.4 refuse the keyword)."""
    return {"launch_pdl": True} if pdl else {}


if gdc_wait is None:
    @triton.jit
    def await_inputs(PDL: tl.constexpr):
        """Nothing: this Triton has no grid dependency control (``PDL`` is always false)."""
        pass
else:
    @triton.jit
    def await_inputs(PDL: tl.constexpr):
        """A kernel's first statement when launched with ``launch_options(PDL)``: wait for
        the kernel before it to finish, then let the kernel after it launch. Nothing when
        ``PDL`` is false."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
