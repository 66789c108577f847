"""Rounding a float32 value to bfloat16 and back inside a Triton kernel, where PyTorch's
op-by-op arithmetic rounds (``hitchllm.models.rotary_kernel``,
``hitchllm.models.elementwise_kernels``).

Compiled for sm_90, Triton folded ``x.to(tl.bfloat16).to(tl.float32)`` away in some
expressions (into fused multiply-adds over the unrounded value: 17% of a kernel's bf16 outputs
differed from PyTorch's on an H100), so on an NVIDIA GPU the conversion pair is one piece of
inline PTX the compiler cannot see through; Triton's interpreter (which truncates where it
converts and runs no PTX) and other GPUs round with integer masks on the bits instead. Both
round to nearest even and keep NaNs NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hitchllm.attention.triton_support import triton_interpreting


def ptx_rounding(t: torch.Tensor) -> bool:
    """The ``PTX`` argument of ``round_to`` for a kernel on ``t``'s device: an NVIDIA GPU (not
    ROCm's), with Triton compiling rather than interpreting."""
    return t.is_cuda and torch.version.hip is None and not triton_interpreting()


@triton.jit
def round_to(x, dt: tl.constexpr, PTX: tl.constexpr):
    """``x`` (float32) rounded to ``dt`` and back (unchanged unless ``dt`` is bfloat16).
    ``PTX``: PTX conversions (``ptx_rounding``), else integer masks."""
    if dt == tl.bfloat16:
        if PTX:
            return tl.inline_asm_elementwise(
                "{ .reg .b16 h; cvt.rn.bf16.f32 h, $1; cvt.f32.bf16 $0, h; }",
                "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
        else:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    else:
        return x
