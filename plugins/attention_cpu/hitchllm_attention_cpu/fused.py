"""CPU kernels for ``hitchllm.models.fused``'s functions (fused_ops.c), one C pass each.

Registered with ``hitchllm.models.fused.register_device_kernels`` for the device type "cpu"
(``install``, called by the plugin once a CPU engine's model is loaded). Which dtypes each
kernel takes:

- ``rotary``: float32 and bfloat16. Products and sums only, rounded as PyTorch rounds them:
  equal to the eager code bit for bit.
- ``rms_norm``, ``add_rms_norm``, ``qk_norm_rotary``, ``silu_and_mul``: bfloat16 only. The sum
  of squares (RMSNorm) and the exponential (SiLU) are computed in another order or another way
  than PyTorch's, so the float32 result can differ in the last bit; float32 runs (whose greedy
  tokens are compared bit for bit with transformers) keep the eager code. In bfloat16 the
  difference shows only where a float32 value sits on a bfloat16 rounding boundary.

Anything else (float16, a layout the kernel does not read: a row that is not contiguous, a
weight in another dtype) returns None, and the function runs as written in PyTorch.
"""

from __future__ import annotations

import torch

from hitchllm_attention_cpu.compiler import load_fused_ops

_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}


def _rows_ok(x: torch.Tensor) -> bool:
    """A [rows, ...] tensor whose rows are each contiguous (any row stride)."""
    return x.dim() >= 2 and x.stride(-1) == 1 and (
        x.dim() == 2 or (x.dim() == 3 and x.stride(1) == x.shape[2]))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    if x.dtype != torch.bfloat16 or weight.dtype != x.dtype or x.dim() != 2 \
            or not _rows_ok(x) or not weight.is_contiguous():
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    load_fused_ops().functions["hitch_rms_norm"](
        x.data_ptr(), x.stride(0), None, 0, None, weight.data_ptr(), out.data_ptr(),
        x.shape[0], x.shape[1], eps, 1, torch.get_num_threads())
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    if x.dtype != torch.bfloat16 or residual.dtype != x.dtype or weight.dtype != x.dtype \
            or x.dim() != 2 or residual.shape != x.shape or not _rows_ok(x) \
            or not _rows_ok(residual) or not weight.is_contiguous():
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    total = torch.empty(x.shape, dtype=x.dtype)
    load_fused_ops().functions["hitch_rms_norm"](
        x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0), total.data_ptr(),
        weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps, 1,
        torch.get_num_threads())
    return out, total


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    if gate_up.dtype != torch.bfloat16 or gate_up.dim() != 2 or not _rows_ok(gate_up) \
            or gate_up.shape[1] % 2:
        return None
    width = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], width, dtype=gate_up.dtype)
    load_fused_ops().functions["hitch_silu_and_mul"](
        gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), gate_up.shape[0], width, 1,
        torch.get_num_threads())
    return out


def _rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor] | None, eps: float,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    d = q.shape[-1]
    if q.dim() != 3 or k.dim() != 3 or k.dtype != q.dtype or k.shape[2] != d or d % 2 \
            or k.shape[0] != q.shape[0] or positions.shape != (q.shape[0],) \
            or positions.dtype != torch.int64 or not positions.is_contiguous() \
            or not _rows_ok(q) or not _rows_ok(k) or cos.dtype != torch.float32 \
            or sin.dtype != torch.float32 or cos.shape != sin.shape \
            or cos.shape[1:] != (d // 2,) or not cos.is_contiguous() \
            or not sin.is_contiguous():
        return None
    if weights is not None and any(w.dtype != q.dtype or w.shape != (d,)
                                   or not w.is_contiguous() for w in weights):
        return None
    q_out = torch.empty(q.shape, dtype=q.dtype)
    k_out = torch.empty(k.shape, dtype=k.dtype)
    q_weight, k_weight = (None, None) if weights is None else (w.data_ptr() for w in weights)
    status = load_fused_ops().functions["hitch_rotary"](
        positions.data_ptr(), q.data_ptr(), q.stride(0), q.shape[1], q_out.data_ptr(),
        k.data_ptr(), k.stride(0), k.shape[1], k_out.data_ptr(), q.shape[0], d,
        cos.data_ptr(), sin.data_ptr(), cos.shape[0], q_weight, k_weight, eps,
        _DTYPE_CODE[q.dtype], torch.get_num_threads())
    if status != 0:
        bad = positions[(positions < 0) | (positions >= cos.shape[0])]
        raise IndexError(f"rotary: position {int(bad[0])} is outside the rotary tables "
                         f"(max_position_embeddings {cos.shape[0]}); keep prompts and "
                         "max_model_len within the model's context length")
    return q_out, k_out


def rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    if q.dtype not in _DTYPE_CODE:
        return None
    return _rotary(positions, q, k, cos, sin, None, 0.0)


def qk_norm_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
    k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    if q.dtype != torch.bfloat16:
        return None
    return _rotary(positions, q, k, cos, sin, (q_weight, k_weight), eps)


KERNELS = {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "rotary": rotary,
           "qk_norm_rotary": qk_norm_rotary, "silu_and_mul": silu_and_mul}


def install() -> None:
    """Register the kernels for the CPU (builds fused_ops.c on first use; raises
    ``KernelBuildError`` when it cannot)."""
    from hitchllm.models import fused

    load_fused_ops()
    fused.register_device_kernels("cpu", KERNELS)
