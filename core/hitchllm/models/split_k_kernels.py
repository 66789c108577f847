"""The Triton kernel of ``hitchllm.models.split_k`` (see there): split-K partial sums of
``x @ weight.T`` (any number of rows; ``split_k`` caps them). The residual add + RMSNorm that
sums them is ``elementwise_kernels.add_rms_norm_of_parts``."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from hitchllm.attention.dependent_launch import (
    await_inputs,
    dependent_launch,
    launch_options,
)

# The shapes measured (Qwen3-0.6B's o_proj 2048 -> 1024 and down_proj 3072 -> 1024); larger
# projections have more output tiles and were not measured against cuBLAS.
_MAX_COLUMNS = 1024
_MAX_INNER = 4096
_DTYPES = (torch.bfloat16, torch.float32)


class _Tiles(NamedTuple):
    rows: int  # BM
    columns: int  # BN
    inner: int  # BK
    splits: int  # S
    stages: int


def tiles(rows: int) -> _Tiles:
    """The tile configuration for a step of ``rows`` rows (the best of a sweep on an H100 with
    the weights coming from memory; benchmarks/RESULTS.md)."""
    if rows <= 16:
        return _Tiles(16, 32, 64, 4, 4)
    if rows <= 64:
        return _Tiles(64, 32, 64, 4, 4)
    return _Tiles(64, 64, 64, 4, 4)


@triton.jit
def _partials_kernel(x_ptr, w_ptr, parts_ptr, rows, columns, stride_x, stride_w, inner_per_split,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
                     PDL: tl.constexpr):
    await_inputs(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = split * inner_per_split + tl.arange(0, BK)
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_x + rk[None, :]
    w_ptrs = w_ptr + rn[None, :].to(tl.int64) * stride_w + rk[:, None]
    acc = tl.zeros((BM, BN), tl.float32)
    for _ in range(0, inner_per_split, BK):
        x = tl.load(x_ptrs, mask=rm[:, None] < rows, other=0.0)
        w = tl.load(w_ptrs)
        acc = tl.dot(x, w, acc, input_precision="ieee") if IEEE else tl.dot(x, w, acc)
        x_ptrs += BK
        w_ptrs += BK
    out = parts_ptr + (split * rows + rm[:, None]).to(tl.int64) * columns + rn[None, :]
    tl.store(out, acc, mask=rm[:, None] < rows)


def partial_sums(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``x @ weight.T`` (``x`` [T, K], ``weight`` [N, K], both bfloat16 or both float32, rows
    contiguous) as float32 partial sums [S, T, N], or None where the shapes do not divide into
    the tiles."""
    rows, inner = x.shape
    columns = weight.shape[0]
    if rows == 0 or columns > _MAX_COLUMNS or inner > _MAX_INNER:
        return None
    t = tiles(rows)
    if columns % t.columns or inner % (t.splits * t.inner) or x.stride(1) != 1 \
            or not weight.is_contiguous() or weight.shape[1] != inner \
            or x.dtype != weight.dtype or x.dtype not in _DTYPES:
        return None
    parts = torch.empty(t.splits, rows, columns, dtype=torch.float32, device=x.device)
    grid = (columns // t.columns, triton.cdiv(rows, t.rows), t.splits)
    pdl = dependent_launch(x)
    _partials_kernel[grid](x, weight, parts, rows, columns, x.stride(0), weight.stride(0),
                           inner // t.splits, BM=t.rows, BN=t.columns, BK=t.inner,
                           IEEE=x.dtype == torch.float32, PDL=pdl, num_warps=4,
                           num_stages=t.stages, **launch_options(pdl))
    return parts
