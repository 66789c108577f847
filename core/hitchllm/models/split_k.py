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

The engine takes this route (``project``) on NVIDIA GPUs for bfloat16, unquantized, bias-free
projections without LoRA on one tensor-parallel rank, in steps of 1 to ``MAX_ROWS`` tokens
(decode steps, and prompt or mixed steps that small), for the measured shapes (up to 1,024
output columns, inner sizes dividing into the tiles); everything else (larger steps, other
dtypes, tensor parallelism, larger projections) runs ``F.linear`` and the norm as before. The
projection's kernel is in ``split_k_kernels``, the add-and-norm's in ``elementwise_kernels``
(imported on first use: Triton is optional for the core).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hitchllm.layers.linear import RowParallelLinear
from hitchllm.layers.method import UnquantizedLinearMethod
from hitchllm.models import fused

#: The most rows (tokens) a split-sum projection takes. Above it cuBLAS tiles enough output to
#: fill the GPU: with the route up to 256 rows, the decode steps of 128-256 requests ran 0.5-1.2%
#: slower in whole runs (the committed tiles measured 0.95-1.05x alone there), and larger
#: steps are compute-bound.
MAX_ROWS = 128


class SplitSum(NamedTuple):
    """A projection's output ``[T, N]`` held as float32 partial sums ``parts`` ``[S, T, N]``
    (their sum in order of ``S``, rounded to ``dtype``: bfloat16 or float32)."""

    parts: torch.Tensor
    dtype: torch.dtype

    def total(self) -> torch.Tensor:
        """The output itself, summed as ``add_rms_norm`` sums it."""
        acc = self.parts[0]
        for part in self.parts[1:]:
            acc = acc + part
        return acc.to(self.dtype)


def add_rms_norm(
    split: SplitSum, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused.add_rms_norm(split.total(), residual, weight, eps)``, summing the parts in the
    same kernel."""
    from hitchllm.models import elementwise_kernels

    out = elementwise_kernels.add_rms_norm_of_parts(split.parts, split.dtype, residual, weight,
                                                    eps)
    return out if out is not None else fused.add_rms_norm(split.total(), residual, weight, eps)


def project(proj: RowParallelLinear, x: torch.Tensor) -> torch.Tensor | SplitSum:
    """``proj(x)``, as a ``SplitSum`` where this route applies: an NVIDIA GPU, bfloat16, fusion
    on, an unquantized projection (no LoRA) without bias on one tensor-parallel rank, no
    autograd, 1-``MAX_ROWS`` rows and shapes that divide into the tiles."""
    if (x.is_cuda and torch.version.hip is None and x.dtype == torch.bfloat16 and x.dim() == 2
            and x.shape[0] <= MAX_ROWS and fused.fusion_enabled() and proj.bias is None
            and proj.tp_size == 1
            and type(proj.linear_method) is UnquantizedLinearMethod
            and not (torch.is_grad_enabled() and (x.requires_grad or proj.weight.requires_grad))):
        from hitchllm.models import split_k_kernels

        parts = split_k_kernels.partial_sums(x, proj.weight)
        if parts is not None:
            return SplitSum(parts, x.dtype)
    return proj(x)
