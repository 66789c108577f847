"""float32 linear layers of 16-32 rows (decode steps) through MKL's packed GEMM.

``F.linear`` in float32 calls MKL's ``sgemm``, which copies the weight into its blocked layout
on every call; at decode sizes that copy is a large part of the call (the bundled model's
192 -> 1024 projection at 32 rows: 85-123 us, 57-101 us on a copy packed once; the LM head 192
-> 4096: 411-451 vs 235-264 us; one or two threads, hot or cold caches). torch exposes MKL's
packed GEMM (``cblas_sgemm_pack`` / ``cblas_sgemm_compute``) as
``torch.ops.mkl._mkl_reorder_linear_weight`` and ``_mkl_linear``; the packed layout is made for
one row count (32 here), so a call of 16-31 rows is padded with zero rows to 32.

Bit for bit ``F.linear``: from about 16 rows on, MKL's ``sgemm`` computes each row in one
order whatever the row count (below that it takes other paths, whose results depend on the
row count, and stay with ``F.linear``), and the packed GEMM is the same arithmetic. ``install``
checks this for each layer's shape (``same_as_f_linear``) on random inputs, and leaves a layer
whose check fails on ``F.linear``; tests/test_cpug_mkl_linear.py checks it on many shapes.
The copy costs the layer's weight memory once more.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from hitchllm.layers import CPU_F32_KERNEL
from hitchllm_attention_cpu.amx_linear import unquantized_linears

logger = logging.getLogger(__name__)

#: The row count the weight is packed for; calls of MIN_ROWS to PACKED_ROWS rows take it.
PACKED_ROWS = 32
#: Fewer rows stay on ``F.linear`` (MKL's small-row paths, another order).
MIN_ROWS = 16
#: Smaller weights stay on ``F.linear``: at 192 x 192 and 320 x 192 the packed GEMM was level
#: with it hot and up to 20% slower with cold caches and OMP_WAIT_POLICY=PASSIVE.
MIN_WEIGHT_ELEMENTS = 96 * 1024


def available() -> bool:
    """Whether this torch has MKL and its packed GEMM operators."""
    return (torch.backends.mkl.is_available()
            and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
            and hasattr(torch.ops.mkl, "_mkl_linear"))


class MklPackedLinear:
    """``x @ W.T`` for float32 ``x`` of ``MIN_ROWS``-``PACKED_ROWS`` contiguous rows, on a copy
    of ``W`` packed at construction for ``PACKED_ROWS`` rows; None for any other ``x``."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.detach()
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, PACKED_ROWS)
        self.k = weight.shape[1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        rows = x.shape[0]
        if (x.dtype != torch.float32 or x.dim() != 2 or not MIN_ROWS <= rows <= PACKED_ROWS
                or x.shape[1] != self.k or not x.is_contiguous() or x.requires_grad):
            return None
        if rows == PACKED_ROWS:
            return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, None, PACKED_ROWS)
        padded = x.new_zeros(PACKED_ROWS, self.k)
        padded[:rows] = x
        out = torch.ops.mkl._mkl_linear(padded, self.packed, self.weight, None, PACKED_ROWS)
        return out[:rows]


@functools.cache
def same_as_f_linear(n: int, k: int) -> bool:
    """Whether the packed GEMM equals ``F.linear`` bit for bit for an [n, k] weight at 16, 24
    and 32 rows, on one thread and on torch's current count (random inputs: a different order
    of sums would show in some of the n * rows outputs). MKL's small-row paths reach further
    for some shapes (33 x 1000 on one thread: 16 rows)."""
    generator = torch.Generator().manual_seed(n * 7919 + k)
    weight = torch.randn(n, k, generator=generator)
    x = torch.randn(PACKED_ROWS, k, generator=generator) * 3
    kernel = MklPackedLinear(weight)
    threads = torch.get_num_threads()
    try:
        for count in sorted({1, threads}):
            torch.set_num_threads(count)
            with torch.inference_mode():
                if not all(torch.equal(kernel(x[:rows]), F.linear(x[:rows], weight))
                           for rows in (MIN_ROWS, 24, PACKED_ROWS)):
                    return False
    finally:
        torch.set_num_threads(threads)
    return True


def install(model: nn.Module) -> int:
    """Attach an ``MklPackedLinear`` to every unquantized float32 linear layer (and LM head) of
    ``model`` with at least ``MIN_WEIGHT_ELEMENTS`` weights whose shape passes
    ``same_as_f_linear``; returns how many layers."""
    if not available():
        return 0
    count = 0
    for module in unquantized_linears(model):
        if (module.weight.dtype == torch.float32 and module.weight.dim() == 2
                and module.weight.device.type == "cpu"
                and module.weight.numel() >= MIN_WEIGHT_ELEMENTS):
            n, k = module.weight.shape
            if same_as_f_linear(n, k):
                module.__dict__[CPU_F32_KERNEL] = MklPackedLinear(module.weight)
                count += 1
            else:
                logger.info("MKL packed GEMM differs from F.linear for a %d x %d weight; that "
                            "layer keeps F.linear", n, k)
    return count
