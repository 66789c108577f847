"""fp8 values packed in 16- or 32-bit words (little-endian: byte ``j`` is the value at
index ``j`` of the word's run), unpacked to fp16 inside Triton kernels.

Every fp8 value (e4m3 and e5m2) is an fp16 value, so each unpacking is exact. On NVIDIA GPUs
the PTX forms convert two values per ``cvt.rn.f16x2.e4m3x2`` (or ``.e5m2x2``) instruction
(compute capability 8.9 or newer); ``byte_to_fp16`` uses Triton's casts and runs anywhere,
Triton's interpreter included.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def byte_to_fp16(w, J: tl.constexpr, fp8_type: tl.constexpr):
    """Byte ``J`` of every int32 word of ``w``, an fp8 value of ``fp8_type``, as fp16."""
    b = (w >> (8 * J)) & 0xFF
    if fp8_type == tl.float8e5:  # e5m2 is fp16's top byte (Triton's interpreter flushes
        # e5m2 subnormals in the cast)
        v = (b << 8).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        v = b.to(tl.uint8).to(fp8_type, bitcast=True).to(tl.float16)
    return v


@triton.jit
def pairs_to_fp16(w, E5M2: tl.constexpr):
    """Both fp8 values of every 16-bit word of ``w`` as fp16, by inline PTX (CUDA only): one
    ``cvt`` per word. (The PTX strings are literals in each branch: Triton has no string
    variables.)"""
    if E5M2:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b32 t; cvt.rn.f16x2.e5m2x2 t, $2; mov.b32 {$0, $1}, t; }", "=h,=h,h",
            [w], dtype=(tl.int16, tl.int16), is_pure=True, pack=1)
    else:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b32 t; cvt.rn.f16x2.e4m3x2 t, $2; mov.b32 {$0, $1}, t; }", "=h,=h,h",
            [w], dtype=(tl.int16, tl.int16), is_pure=True, pack=1)
    return lo.to(tl.float16, bitcast=True), hi.to(tl.float16, bitcast=True)


@triton.jit
def quads_to_fp16(w, E5M2: tl.constexpr):
    """The four fp8 values of every 32-bit word of ``w`` as fp16, by inline PTX (CUDA only):
    one ``cvt`` per 16-bit half."""
    if E5M2:
        v0, v1, v2, v3 = tl.inline_asm_elementwise(
            "{ .reg .b16 l, h; .reg .b32 a, b; mov.b32 {l, h}, $4; "
            "cvt.rn.f16x2.e5m2x2 a, l; cvt.rn.f16x2.e5m2x2 b, h; "
            "mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }", "=h,=h,=h,=h,r", [w],
            dtype=(tl.int16, tl.int16, tl.int16, tl.int16), is_pure=True, pack=1)
    else:
        v0, v1, v2, v3 = tl.inline_asm_elementwise(
            "{ .reg .b16 l, h; .reg .b32 a, b; mov.b32 {l, h}, $4; "
            "cvt.rn.f16x2.e4m3x2 a, l; cvt.rn.f16x2.e4m3x2 b, h; "
            "mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }", "=h,=h,=h,=h,r", [w],
            dtype=(tl.int16, tl.int16, tl.int16, tl.int16), is_pure=True, pack=1)
    return (v0.to(tl.float16, bitcast=True), v1.to(tl.float16, bitcast=True),
            v2.to(tl.float16, bitcast=True), v3.to(tl.float16, bitcast=True))
