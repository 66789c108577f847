"""RMSNorm, the residual add + RMSNorm and SiLU-and-multiply as Triton kernels on CUDA: the
kernels of ``fused.rms_norm``, ``fused.add_rms_norm`` and ``fused.silu_and_mul``, and the
add-and-norm that sums ``hitchllm.models.split_k``'s partial products.

``torch.compile`` made these functions' kernels before. Loading its compiled functions (Dynamo,
Inductor and the Python they import) was most of an H100 engine's 12-14 s "KV cache sizing"
phase at start-up in every process, for three kernels a few lines long; these launch like the
engine's other Triton kernels, dependently where the GPU allows
(``hitchllm.attention.dependent_launch``).

The arithmetic is ``fused``'s, rounding where PyTorch's op-by-op arithmetic rounds
(``hitchllm.models.rounding``): the residual sum rounded to the model dtype, statistics in
float32, the normalized value rounded before the weight multiplies it and the product rounded;
``silu(gate)`` rounded before it multiplies ``up``, with the accurate exponential and an
IEEE division, as PyTorch computes it. bfloat16 and float32 only (``rounding.round_to`` has
no float16 rounding: the compiled route keeps float16), and no autograd (the kernels have no
backward: arguments that need gradients take the compiled route too). A row's sum of squares
is reduced in another order than PyTorch's, so a normalized value can round the other way,
rarely.

One program normalizes one row (up to 16,384 columns); SiLU-and-multiply takes 1,024 columns
of one row per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from hitchllm.attention.dependent_launch import (
    await_inputs,
    dependent_launch,
    launch_options,
)
from hitchllm.attention.triton_support import triton_interpreting
from hitchllm.models.rounding import ptx_rounding, round_to

_DTYPES = (torch.bfloat16, torch.float32)
_MAX_COLUMNS = 16384
_SILU_BLOCK = 1024


# A step's row count is an argument of its own, not specialized (1 or a multiple of 16 would
# each compile another variant on a request's step).
@triton.jit(do_not_specialize=["rows"])
def _norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, total_ptr, rows, columns,
                 inv_columns, stride_x, stride_residual, eps, SPLITS: tl.constexpr,
                 ADD: tl.constexpr, BLOCK: tl.constexpr, PTX: tl.constexpr, PDL: tl.constexpr):
    """Row ``row`` of ``x`` (``SPLITS`` float32 partial sums [SPLITS, rows, columns] when
    ``SPLITS`` > 1, rounded to the output dtype once summed), plus the residual (``ADD``;
    the sum also stored to ``total``), normalized and scaled by the weight."""
    await_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < columns
    dt = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    for split in tl.static_range(1, SPLITS):
        x += tl.load(x_ptr + (split * rows + row) * stride_x + c, mask=mask, other=0.0)
    x = round_to(x, dt, PTX)
    if ADD:
        residual = tl.load(residual_ptr + row * stride_residual + c, mask=mask, other=0.0)
        x = round_to(x + residual.to(tl.float32), dt, PTX)
        tl.store(total_ptr + row * columns + c, x.to(dt), mask=mask)
    # The mean as PyTorch's on CUDA (sum * (1 / n)); launched without fused multiply-adds, so
    # the squares, the mean and the epsilon round where PyTorch's ops round.
    inv = tl.rsqrt(tl.sum(x * x, 0) * inv_columns + eps)
    weight = tl.load(weight_ptr + c, mask=mask, other=0.0).to(tl.float32)
    normed = round_to(weight * round_to(x * inv, dt, PTX), dt, PTX)
    tl.store(out_ptr + row * columns + c, normed.to(dt), mask=mask)


def _as_rows(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` [H] or [T, H] (columns contiguous, any row stride) as [rows, H], or None.

    Not more dimensions: whether a [tokens, heads, d] view is rows of d can depend on the token
    count (PyTorch gives a one-token view the strides of a contiguous tensor), and a call must
    take the same route at every step (one kernel, one rounding, nothing first compiled on a
    request's step)."""
    if x.dim() not in (1, 2) or x.stride(-1) != 1:
        return None
    return x if x.dim() == 2 else x.view(1, -1)


def _needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd would record an op on these tensors (the kernels have no backward)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _takes(x: torch.Tensor, weight: torch.Tensor, columns: int) -> bool:
    return (x.dtype in _DTYPES and weight.dtype == x.dtype and weight.shape == (columns,)
            and weight.is_contiguous() and weight.device == x.device
            and 0 < columns <= _MAX_COLUMNS and not _needs_grad(x, weight))


def _launch_norm(x: torch.Tensor, splits: int, residual: torch.Tensor | None,
                 weight: torch.Tensor, eps: float, dtype: torch.dtype,
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    rows, columns = x.shape[-2:]
    out = torch.empty(rows, columns, dtype=dtype, device=x.device)
    total = torch.empty_like(out) if residual is not None else None
    if rows:
        block = triton.next_power_of_2(columns)
        pdl = dependent_launch(x)
        _norm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, out,
            total if total is not None else out, rows, columns, 1.0 / columns, x.stride(-2),
            residual.stride(0) if residual is not None else 0, eps, SPLITS=splits,
            ADD=residual is not None, BLOCK=block, PTX=ptx_rounding(x), PDL=pdl,
            num_warps=min(16, max(4, block // 1024)), enable_fp_fusion=False,
            **launch_options(pdl))
    return out, total


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``fused.rms_norm`` of ``x`` [T, H] or [H] (the last dimension contiguous), or None for
    arguments this kernel does not take."""
    rows = _as_rows(x)
    if rows is None or not _takes(x, weight, x.shape[-1]):
        return None
    return _launch_norm(rows, 1, None, weight, eps, x.dtype)[0].view(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``fused.add_rms_norm`` of ``x`` and ``residual`` [T, H] or [H] (the last dimension
    contiguous), or None for arguments this kernel does not take."""
    rows, residual_rows = _as_rows(x), _as_rows(residual)
    if not (rows is not None and residual_rows is not None and residual.shape == x.shape
            and residual.dtype == x.dtype and residual.device == x.device
            and not _needs_grad(residual) and _takes(x, weight, x.shape[-1])):
        return None
    out, total = _launch_norm(rows, 1, residual_rows, weight, eps, x.dtype)
    assert total is not None
    return out.view(x.shape), total.view(x.shape)


def add_rms_norm_of_parts(
    parts: torch.Tensor, dtype: torch.dtype, residual: torch.Tensor, weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``split_k.add_rms_norm``: the float32 partial sums ``parts`` [S, T, H] of a ``dtype``
    output summed in split order, added to ``residual`` and normalized; None for arguments
    this kernel does not take."""
    _, rows, columns = parts.shape
    if not (parts.dtype == torch.float32 and parts.is_contiguous()
            and residual.shape == (rows, columns) and residual.dtype == dtype
            and residual.stride(1) == 1 and residual.device == parts.device
            and dtype in _DTYPES and not _needs_grad(parts)
            and _takes(residual, weight, columns)):
        return None
    out, total = _launch_norm(parts, parts.shape[0], residual, weight, eps, dtype)
    assert total is not None
    return out, total


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, columns, stride_x, BLOCK: tl.constexpr,
                     LIBDEVICE: tl.constexpr, PTX: tl.constexpr, PDL: tl.constexpr):
    await_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < columns
    dt = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + columns + c, mask=mask, other=0.0).to(tl.float32)
    # Compiled, libdevice's exponential is the accurate one (CUDA's expf on NVIDIA GPUs); the
    # interpreter has no libdevice.
    exp = libdevice.exp(-gate) if LIBDEVICE else tl.exp(-gate)
    silu = round_to(tl.div_rn(gate, 1.0 + exp), dt, PTX)
    tl.store(out_ptr + row * columns + c, round_to(silu * up, dt, PTX).to(dt), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``fused.silu_and_mul`` of ``gate_up`` [T, 2I] or [2I] (the last dimension contiguous), or
    None for arguments this kernel does not take."""
    x = _as_rows(gate_up)
    if (x is None or gate_up.dtype not in _DTYPES or gate_up.shape[-1] % 2
            or _needs_grad(gate_up)):
        return None
    rows, columns = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, columns, dtype=x.dtype, device=x.device)
    if rows and columns:
        pdl = dependent_launch(x)
        _silu_mul_kernel[(rows, triton.cdiv(columns, _SILU_BLOCK))](
            x, out, columns, x.stride(0), BLOCK=_SILU_BLOCK, LIBDEVICE=not triton_interpreting(),
            PTX=ptx_rounding(x), PDL=pdl, num_warps=4, **launch_options(pdl))
    return out.view(*gate_up.shape[:-1], columns)
