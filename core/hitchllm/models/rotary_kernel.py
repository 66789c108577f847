"""Rotary embedding of queries and keys, with Qwen3's per-head RMSNorm before it, as one
Triton kernel on CUDA.

``torch.compile`` turns ``fused.qk_norm_rotary`` into four kernels (a reduction and a
pointwise pass for queries and for keys, with dynamic shapes): in the engine's profiles on an
H100 about 7.6 us a layer at 64 decode tokens and 0.5 ms at 8,192 prompt tokens; alone
(``benchmarks/rotary_kernel.py``, H100) 21.8 and 524 us against this kernel's 2.7 and 43 us.
One program takes one token: every query and key head of it, normalized (when weights are
given) and rotated, written to new contiguous tensors.

The arithmetic is ``fused``'s, rounding where it rounds: statistics in float32, the normalized
value rounded to the model dtype before the weight multiplies it, the float32 cos/sin tables
rounded to the model dtype, and each product and sum of the rotation rounded
(``hitchllm.models.rounding``). bfloat16 and float32 only: compiled for sm_90, float16's
products fold into fused multiply-adds that skip their roundings, so float16 stays on the
compiled route. Positions must lie within the tables (the engine's do); they are not checked
on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hitchllm.attention.dependent_launch import (
    await_inputs,
    dependent_launch,
    launch_options,
)
from hitchllm.models.rounding import ptx_rounding, round_to

_DTYPES = (torch.bfloat16, torch.float32)


@triton.jit
def _heads(x_ptr, out_ptr, w_ptr, c, s, token, stride_t, stride_h, eps,
           HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr,
           HALF_PAD: tl.constexpr, NORM: tl.constexpr, PTX: tl.constexpr):
    """Normalize (``NORM``) and rotate the ``HEADS`` heads of one token."""
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HALF_PAD)
    mask = (h < HEADS)[:, None] & (d < HALF)[None, :]
    src = x_ptr + token * stride_t + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    if NORM:
        inv = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(w_ptr + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
        x1 = round_to(w1 * round_to(x1 * inv, dt, PTX), dt, PTX)
        x2 = round_to(w2 * round_to(x2 * inv, dt, PTX), dt, PTX)
    out1 = round_to(x1 * c, dt, PTX) - round_to(x2 * s, dt, PTX)
    out2 = round_to(x2 * c, dt, PTX) + round_to(x1 * s, dt, PTX)
    dst = out_ptr + token * (HEADS * 2 * HALF) + h[:, None] * (2 * HALF) + d[None, :]
    tl.store(dst, round_to(out1, dt, PTX).to(dt), mask=mask)
    tl.store(dst + HALF, round_to(out2, dt, PTX).to(dt), mask=mask)


@triton.jit
def _norm_rotary_kernel(
    pos_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, eps,
    Q_HEADS: tl.constexpr, Q_PAD: tl.constexpr, K_HEADS: tl.constexpr, K_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, NORM: tl.constexpr, PTX: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    d = tl.arange(0, HALF_PAD)
    dt = q_out_ptr.dtype.element_ty
    c = round_to(tl.load(cos_ptr + pos * HALF + d, mask=d < HALF, other=0.0), dt, PTX)
    s = round_to(tl.load(sin_ptr + pos * HALF + d, mask=d < HALF, other=0.0), dt, PTX)
    _heads(q_ptr, q_out_ptr, q_w_ptr, c[None, :], s[None, :], token, stride_qt, stride_qh, eps,
           Q_HEADS, Q_PAD, HALF, HALF_PAD, NORM, PTX)
    _heads(k_ptr, k_out_ptr, k_w_ptr, c[None, :], s[None, :], token, stride_kt, stride_kh, eps,
           K_HEADS, K_PAD, HALF, HALF_PAD, NORM, PTX)


def _launch(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    weights = () if q_weight is None or k_weight is None else (q_weight, k_weight)
    tensors = (positions, q, k, cos, sin, *weights)
    if not (q.dim() == k.dim() == 3 and q.dtype == k.dtype and q.dtype in _DTYPES
            and q.shape[2] == k.shape[2] and q.shape[2] % 2 == 0 and q.shape[0] == k.shape[0]
            and q.stride(2) == 1 and k.stride(2) == 1
            and positions.shape == (q.shape[0],) and positions.is_contiguous()
            and not positions.is_floating_point()
            and cos.dim() == 2 and cos.shape == sin.shape and cos.shape[1] * 2 == q.shape[2]
            and cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous()
            and sin.is_contiguous()
            and all(t.device == q.device for t in tensors)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))):
        return None
    if q_weight is not None and not (
            len(weights) == 2 and q_weight.dtype == k_weight.dtype == q.dtype
            and q_weight.shape == k_weight.shape == (q.shape[2],)
            and q_weight.is_contiguous() and k_weight.is_contiguous()):
        return None
    tokens, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    q_out = torch.empty((tokens, q_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((tokens, k_heads, head_dim), dtype=k.dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    norm = q_weight is not None
    pdl = dependent_launch(q)
    _norm_rotary_kernel[(tokens,)](
        positions, q, k, q_out, k_out, q_weight if norm else q, k_weight if norm else k,
        cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), eps,
        Q_HEADS=q_heads, Q_PAD=triton.next_power_of_2(q_heads), K_HEADS=k_heads,
        K_PAD=triton.next_power_of_2(k_heads), HALF=head_dim // 2,
        HALF_PAD=triton.next_power_of_2(head_dim // 2), NORM=norm, PTX=ptx_rounding(q),
        PDL=pdl, num_warps=4, **launch_options(pdl),
    )
    return q_out, k_out


def rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``fused.rotary`` in one kernel, or None for arguments it does not take (float16, another
    layout or device, autograd), which then run compiled."""
    return _launch(positions, q, k, cos, sin, None, None, 0.0)


def qk_norm_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
    k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``fused.qk_norm_rotary`` in one kernel, or None (as ``rotary``)."""
    return _launch(positions, q, k, cos, sin, q_weight, k_weight, eps)
