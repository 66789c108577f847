"""fp8 (e4m3) W8A8 arithmetic: quantizing weights per output channel and activations per
token, and the GEMM ``y = (xq @ wq.T) * x_scale * w_scale``.

On a CUDA device with fp8 tensor cores (compute capability 8.9 and up: Ada, Hopper and later)
the GEMM is ``torch._scaled_mm`` with row-wise scales. Its rules (torch 2.11 and 2.13 alike):
``mat1`` ``[M, K]`` row-major and ``mat2`` ``[K, N]`` column-major, both fp8; ``K`` and ``N``
divisible by 16 (``M`` may be anything: the row-wise kernels pad the row scales themselves);
``scale_a`` ``[M, 1]`` and ``scale_b`` ``[1, N]``, float32 and contiguous. The GEMM always
writes bfloat16 and casts to the model dtype (see ``scaled_mm_fp8_linear``). A weight whose
``K`` or ``N`` is not a multiple of 16 takes the emulated path below.

Everywhere else (the CPU, for tests) ``emulated_fp8_linear`` computes the same numbers with
float32 arithmetic: activations rounded to fp8 per token exactly as on the GPU, the fp8 weight
values, a float32 matmul, then both scales.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# Keeps an all-zero row's scale positive; any row whose scale would be smaller has all its
# values below FP8_MAX * MIN_SCALE in magnitude, so nothing saturates.
MIN_SCALE = 1e-12


def fp8_capable(device: torch.device) -> bool:
    """Whether ``device`` runs ``torch._scaled_mm`` (CUDA, compute capability >= 8.9)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def check_fp8_device(device: torch.device) -> None:
    """Refuse a CUDA device without fp8 tensor cores (the CPU runs the emulated path)."""
    if device.type == "cuda" and not fp8_capable(device):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(
            f"fp8 weights (W8A8) need a GPU with fp8 tensor cores, compute capability 8.9 or "
            f"newer (sm_89+: Ada L4/L40/RTX 40xx, Hopper H100/H200 or later); "
            f"{torch.cuda.get_device_name(device)} is sm_{major}{minor}. Use an unquantized "
            "checkpoint on this card, or run on the CPU"
        )


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric fp8 per row: ``(values [N, K] fp8, scales [N] float32)`` with
    ``scale = amax / 448``, so ``weight ~= values * scale[:, None]``."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def _quantize_activations(
    x: torch.Tensor, static_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    if static_scale is None:
        scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    else:
        scale = static_scale.reshape(1, 1).expand(x.shape[0], 1).contiguous()
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


_compiled_quantize: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
_eager_only = False


def quantize_activations(
    x: torch.Tensor, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` to ``(fp8 values, float32 scales [M, 1])``: one scale per token
    (``amax / 448``), or the checkpoint's static per-tensor ``static_scale`` for every token.
    Values beyond the static range saturate at +-448, as fp8 inference does.

    On CUDA it runs compiled (``torch.compile``): one fused kernel reads ``x`` once and writes
    fp8, where eager PyTorch makes six passes over a float32 copy, which at M = 8192 would
    cost about half the fp8 GEMM's time. If dynamo's recompile limit is hit (many engines in
    one process), later calls run eagerly: the same arithmetic."""
    global _compiled_quantize, _eager_only
    if not x.is_cuda or _eager_only:
        return _quantize_activations(x, static_scale)
    if _compiled_quantize is None:
        _compiled_quantize = torch.compile(_quantize_activations, dynamic=True,
                                           fullgraph=True)
    from torch._dynamo.exc import FailOnRecompileLimitHit

    try:
        return _compiled_quantize(x, static_scale)
    except FailOnRecompileLimitHit:
        _eager_only = True
        return _quantize_activations(x, static_scale)


def emulated_fp8_linear(
    xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(xq @ weight.T) * x_scale * weight_scale`` in float32 (fp8 products are exact in
    float32; the sum is float32, as the tensor cores accumulate)."""
    out = (xq.float() @ weight.float().t()) * x_scale * weight_scale.view(1, -1)
    return out.to(out_dtype)


def scaled_mm_fits(weight: torch.Tensor) -> bool:
    """Whether ``torch._scaled_mm`` takes this ``[N, K]`` weight (both divisible by 16)."""
    return weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


def scaled_mm_fp8_linear(
    xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The same product on fp8 tensor cores: ``weight`` ``[N, K]`` row-major, so ``weight.t()``
    is the column-major ``mat2`` that ``torch._scaled_mm`` wants.

    Row-wise scaled ``torch._scaled_mm`` always writes bfloat16 here: asked for float32 or
    float16 on an H100 (torch 2.11) it accepted, yet rounded as coarsely as bfloat16 or worse
    (float32 out: relative errors of 5%), so a float32 promise would be false. The bfloat16
    result is cast to ``out_dtype``.

    ``use_fast_accum``: the tensor cores keep the running sum in their own accumulator instead
    of promoting it to float32 registers every few K steps. Measured on an H100 (4096 x 14336,
    M = 2048..8192): 1.67x bf16 instead of 1.50x, and the same error against a float32
    reference to four digits (0.0375: the fp8 rounding of the inputs dominates)."""
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1),
                           out_dtype=torch.bfloat16, use_fast_accum=True)
    return out if out_dtype == torch.bfloat16 else out.to(out_dtype)
