"""float32 linear layers of 16-32 rows (decode steps) through MKL's packed GEMM.

``F.linear`` in float32 calls MKL's ``sgemm``, which copies the weight into its blocked layout
on every call; at decode sizes that copy is a large part of the call (the bundled model's
192 -> 1024 projection at 32 rows: 85-123 us, 57-101 us on a copy packed once; the LM head 192
-> 4096: 411-451 vs 235-264 us; one or two threads, hot or cold caches). torch exposes MKL's
packed GEMM (``cblas_sgemm_pack`` / ``cblas_sgemm_compute``) through its operators, but
packs into an opaque tensor whose address the decode layer's C code (decode_layer.py) cannot
take; so the weight is packed here with libtorch's exported ``cblas_sgemm_pack`` into a plain
buffer, and multiplied with its ``cblas_sgemm_compute`` (the same MKL functions with the same
arguments as ``torch.ops.mkl._mkl_linear``). The packed layout is made for one row count (32
here), so a call of 16-31 rows is padded with zero rows to 32.

Bit for bit ``F.linear``: from about 16 rows on, MKL's ``sgemm`` computes each row in one
order whatever the row count (below that it takes other paths, whose results depend on the
row count, and stay with ``F.linear``), and the packed GEMM is the same arithmetic. ``install``
checks this for each layer's shape (``same_as_f_linear``) on random inputs, and leaves a layer
whose check fails on ``F.linear``; tests/test_cpug_mkl_linear.py checks it on many shapes.
The copy costs the layer's weight memory once more.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from hitchllm.layers import CPU_F32_KERNEL
from hitchllm_attention_cpu import torch_symbols
from hitchllm_attention_cpu.amx_linear import unquantized_linears

logger = logging.getLogger(__name__)

#: The row count the weight is packed for; calls of MIN_ROWS to PACKED_ROWS rows take it.
PACKED_ROWS = 32
#: Fewer rows stay on ``F.linear`` (MKL's small-row paths, another order).
MIN_ROWS = 16
#: Smaller weights stay on ``F.linear``: at 192 x 192 and 320 x 192 the packed GEMM was level
#: with it hot and up to 20% slower with cold caches and OMP_WAIT_POLICY=PASSIVE.
MIN_WEIGHT_ELEMENTS = 96 * 1024


# CBLAS's constants (mkl_cblas.h).
_ROW_MAJOR, _NO_TRANS, _TRANS, _PACKED, _B_MATRIX = 101, 111, 112, 151, 162
# MKL's packed buffers are read with aligned loads; the buffer must not move once packed.
_ALIGNMENT = 64


@functools.cache
def _blas() -> dict[str, ctypes._CFuncPtr] | None:
    """libtorch's packed-GEMM functions (MKL's LP64 interface: 32-bit integers), or None where
    torch has no MKL or does not export them."""
    if not torch.backends.mkl.is_available():
        return None
    functions = {name: torch_symbols.function(name) for name in (
        "cblas_sgemm_pack_get_size", "cblas_sgemm_pack", "cblas_sgemm_compute", "sgemm_")}
    if any(f is None for f in functions.values()):
        return None
    i, p = ctypes.c_int, ctypes.c_void_p
    functions["cblas_sgemm_pack_get_size"].argtypes = [i, i, i, i]
    functions["cblas_sgemm_pack_get_size"].restype = ctypes.c_size_t
    functions["cblas_sgemm_pack"].argtypes = [i, i, i, i, i, i, ctypes.c_float, p, i, p]
    functions["cblas_sgemm_pack"].restype = None
    functions["cblas_sgemm_compute"].argtypes = [i, i, i, i, i, i, p, i, p, i, ctypes.c_float,
                                                 p, i]
    functions["cblas_sgemm_compute"].restype = None
    return functions  # type: ignore[return-value]


def available() -> bool:
    """Whether this torch has MKL and exports its packed GEMM."""
    return _blas() is not None


def exact_float32() -> bool:
    """Whether ``F.linear`` multiplies float32 in float32 now: not when the user allowed
    oneDNN a lower precision (``torch.set_float32_matmul_precision("medium")``, or
    ``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``), where it rounds its inputs and
    the packed GEMM would give other results than the modules asked for."""
    matmul = getattr(torch.backends.mkldnn, "matmul", None)
    if matmul is None or not hasattr(matmul, "fp32_precision"):
        return torch.get_float32_matmul_precision() == "highest"
    # The most specific setting that is not "none" (inherit) decides.
    for setting in (matmul, torch.backends.mkldnn, torch.backends):
        precision = getattr(setting, "fp32_precision", "none")
        if precision != "none":
            return precision == "ieee"
    return True


def gemm_addresses() -> tuple[int, int]:
    """The addresses of libtorch's ``sgemm_`` (what ``F.linear`` calls in float32) and
    ``cblas_sgemm_compute``, for C code that multiplies as this module and ``F.linear`` do
    (decode_layer.c); requires ``available()``."""
    blas = _blas()
    assert blas is not None
    return (ctypes.cast(blas["sgemm_"], ctypes.c_void_p).value or 0,
            ctypes.cast(blas["cblas_sgemm_compute"], ctypes.c_void_p).value or 0)


class MklPackedLinear:
    """``x @ W.T`` for float32 ``x`` of ``MIN_ROWS``-``PACKED_ROWS`` contiguous rows, on a copy
    of ``W`` packed at construction for ``PACKED_ROWS`` rows (``packed_address``); None for any
    other ``x``."""

    def __init__(self, weight: torch.Tensor) -> None:
        blas = _blas()
        assert blas is not None, "check available() first"
        self.n, self.k = weight.shape
        size = blas["cblas_sgemm_pack_get_size"](_B_MATRIX, PACKED_ROWS, self.n, self.k)
        self._buffer = torch.empty(size + _ALIGNMENT, dtype=torch.uint8)
        #: Where the packed weight starts (aligned) in a buffer this object keeps.
        self.packed_address = -(-self._buffer.data_ptr() // _ALIGNMENT) * _ALIGNMENT
        contiguous = weight.detach().contiguous()
        blas["cblas_sgemm_pack"](_ROW_MAJOR, _B_MATRIX, _TRANS, PACKED_ROWS, self.n, self.k,
                                 1.0, contiguous.data_ptr(), self.k, self.packed_address)
        self._compute = blas["cblas_sgemm_compute"]

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        rows = x.shape[0]
        if (x.dtype != torch.float32 or x.dim() != 2 or not MIN_ROWS <= rows <= PACKED_ROWS
                or x.shape[1] != self.k or not x.is_contiguous() or x.requires_grad
                or not exact_float32()):
            return None
        if rows != PACKED_ROWS:
            padded = x.new_zeros(PACKED_ROWS, self.k)
            padded[:rows] = x
            x = padded
        out = x.new_empty(PACKED_ROWS, self.n)
        self._compute(_ROW_MAJOR, _NO_TRANS, _PACKED, PACKED_ROWS, self.n, self.k, x.data_ptr(),
                      self.k, self.packed_address, self.k, 0.0, out.data_ptr(), self.n)
        return out if rows == PACKED_ROWS else out[:rows]


@functools.cache
def same_as_f_linear(n: int, k: int) -> bool:
    """Whether the packed GEMM equals ``F.linear`` bit for bit for an [n, k] weight at 16, 24
    and 32 rows, on one thread and on torch's current count (random inputs: a different order
    of sums would show in some of the n * rows outputs). MKL's small-row paths reach further
    for some shapes (33 x 1000 on one thread: 16 rows)."""
    generator = torch.Generator().manual_seed(n * 7919 + k)
    weight = torch.randn(n, k, generator=generator, dtype=torch.float32)
    x = torch.randn(PACKED_ROWS, k, generator=generator, dtype=torch.float32) * 3
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
