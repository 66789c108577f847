"""A decoder layer's two row-parallel projections (attention's ``o_proj``, the MLP's
``down_proj``) at decode sizes as split-K partial sums that the residual add and RMSNorm after
them add up, on CUDA: two Triton kernels where cuBLAS and the norm took two as well, but
faster ones.

At decode sizes these projections read little weight (4-6 MB for Qwen3-0.6B) into few output
columns (1,024), and cuBLAS spreads them over too few tiles: on an H100 at 1-128 rows it took
5-8 us where the weights read in 1.4-2.1 us. ``partial_sums`` splits the inner dimension over
``S`` programs per output tile, each writing its float32 partial product, and ``add_rms_norm``
(one program per row) sums the ``S`` parts in split order, rounds the sum to the model dtype
(the projection's output), then adds the residual and normalizes as ``fused.add_rms_norm``
does. Projection and norm together, H100, Qwen3-0.6B shapes, weights from memory, CUDA graphs
(``benchmarks/split_k.py``): ``o_proj`` 8.1-8.7 -> 6.7-7.6 us, ``down_proj`` 10.1-11.2 ->
8.0-8.7 us at 1-128 rows; whole runs gained 0.6-0.8%, decode steps of 1-63 requests 2.5-6%
(RESULTS.md). The sums are deterministic (no atomics): a row's bits depend only on the tile
configuration, which depends only on the step's row count, and the engine pads eager decode
batches to the graph sizes, so graph and eager runs agree.

The engine takes this route for bfloat16, unquantized, bias-free projections without LoRA in a
world of one, from 1 to ``MAX_ROWS`` rows, when the shapes divide into the tiles below
(``project``); everything else (prompt steps, other dtypes, tensor parallelism) runs
``F.linear`` and the norm as before.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from hitchllm.layers.linear import RowParallelLinear
from hitchllm.layers.method import UnquantizedLinearMethod
from hitchllm.models import fused
from hitchllm.models.rounding import round_to

#: The most rows (tokens) a split-sum projection takes. Above it cuBLAS tiles enough output to
#: fill the GPU: at 129-256 rows the split route measured 1.03-1.13x alone but lost 1% in
#: whole runs (the decode steps of 128-256 requests), and prompt steps are compute-bound.
MAX_ROWS = 128
# Output columns and inner size up to which the split pays (few output tiles); larger
# projections were not measured.
_MAX_COLUMNS = 2048
_MAX_INNER = 8192


class SplitSum(NamedTuple):
    """A projection's output ``[T, N]`` held as float32 partial sums ``parts`` ``[S, T, N]``
    (their sum in order of ``S``, rounded to ``dtype``)."""

    parts: torch.Tensor
    dtype: torch.dtype

    def total(self) -> torch.Tensor:
        """The output itself, summed as ``add_rms_norm`` sums it."""
        acc = self.parts[0]
        for part in self.parts[1:]:
            acc = acc + part
        return acc.to(self.dtype)


class _Tiles(NamedTuple):
    rows: int  # BM
    columns: int  # BN
    inner: int  # BK
    splits: int  # S
    stages: int


def _tiles(rows: int) -> _Tiles:
    # The best of a sweep on an H100 (o_proj 2048 -> 1024, down_proj 3072 -> 1024).
    if rows <= 16:
        return _Tiles(16, 32, 64, 4, 4)
    if rows <= 64:
        return _Tiles(64, 32, 64, 4, 4)
    return _Tiles(64, 64, 64, 4, 4)


@triton.jit
def _partials_kernel(x_ptr, w_ptr, parts_ptr, rows, columns, stride_x, stride_w, inner_per_split,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
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


def partial_sums(x: torch.Tensor, weight: torch.Tensor) -> SplitSum | None:
    """``x @ weight.T`` (``x`` [T, K], ``weight`` [N, K], both of one dtype, rows contiguous)
    as a ``SplitSum``, or None where the shapes do not divide into the tiles."""
    rows, inner = x.shape
    columns = weight.shape[0]
    if not 0 < rows <= MAX_ROWS or columns > _MAX_COLUMNS or inner > _MAX_INNER:
        return None
    t = _tiles(rows)
    if columns % t.columns or inner % (t.splits * t.inner) or x.stride(1) != 1 \
            or not weight.is_contiguous() or weight.shape[1] != inner or x.dtype != weight.dtype:
        return None
    parts = torch.empty(t.splits, rows, columns, dtype=torch.float32, device=x.device)
    grid = (columns // t.columns, triton.cdiv(rows, t.rows), t.splits)
    _partials_kernel[grid](x, weight, parts, rows, columns, x.stride(0), weight.stride(0),
                           inner // t.splits, BM=t.rows, BN=t.columns, BK=t.inner,
                           IEEE=x.dtype == torch.float32, num_warps=4, num_stages=t.stages)
    return SplitSum(parts, x.dtype)


@triton.jit
def _add_norm_kernel(parts_ptr, residual_ptr, weight_ptr, out_ptr, total_ptr, rows, columns,
                     stride_residual, eps, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                     PTX: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < columns
    dt = out_ptr.dtype.element_ty
    acc = tl.load(parts_ptr + row * columns + c, mask=mask, other=0.0)
    for split in tl.static_range(1, SPLITS):
        acc += tl.load(parts_ptr + (split * rows + row) * columns + c, mask=mask, other=0.0)
    residual = tl.load(residual_ptr + row * stride_residual + c, mask=mask, other=0.0)
    total = round_to(round_to(acc, dt, PTX) + residual.to(tl.float32), dt, PTX)
    inv = tl.rsqrt(tl.sum(total * total, 0) / columns + eps)
    weight = tl.load(weight_ptr + c, mask=mask, other=0.0).to(tl.float32)
    normed = round_to(weight * round_to(total * inv, dt, PTX), dt, PTX)
    tl.store(out_ptr + row * columns + c, normed.to(dt), mask=mask)
    tl.store(total_ptr + row * columns + c, total.to(dt), mask=mask)


def add_rms_norm(
    split: SplitSum, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused.add_rms_norm(split.total(), residual, weight, eps)``, summing the parts in the
    same pass."""
    parts = split.parts
    _, rows, columns = parts.shape
    if not (residual.shape == (rows, columns) and residual.dtype == split.dtype == weight.dtype
            and residual.stride(1) == 1 and weight.shape == (columns,)
            and weight.is_contiguous() and residual.device == parts.device == weight.device):
        return fused.add_rms_norm(split.total(), residual, weight, eps)
    out = torch.empty(rows, columns, dtype=split.dtype, device=parts.device)
    total = torch.empty_like(out)
    _add_norm_kernel[(rows,)](parts, residual, weight, out, total, rows, columns,
                              residual.stride(0), eps, SPLITS=parts.shape[0],
                              BLOCK=triton.next_power_of_2(columns), PTX=parts.is_cuda,
                              num_warps=4)
    return out, total


def project(proj: RowParallelLinear, x: torch.Tensor) -> torch.Tensor | SplitSum:
    """``proj(x)``, as a ``SplitSum`` where this route applies: CUDA, bfloat16, fusion on,
    an unquantized projection (no LoRA) without bias in a world of one, 1-``MAX_ROWS`` rows
    and shapes that divide into the tiles."""
    if (x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and fused.fusion_enabled()
            and proj.bias is None and proj.tp_size == 1
            and type(proj.linear_method) is UnquantizedLinearMethod
            and not (torch.is_grad_enabled() and (x.requires_grad or proj.weight.requires_grad))):
        split = partial_sums(x, proj.weight)
        if split is not None:
            return split
    return proj(x)
