"""CPU kernels for ``hitchllm.models.fused``'s functions (fused_ops.c), one C pass each.

Registered with ``hitchllm.models.fused.register_device_kernels`` for the device type "cpu"
(``install``, called by the plugin once a CPU engine's model is loaded). Which dtypes each
kernel takes:

- ``rotary``: float32 and bfloat16. Products and sums only, rounded as PyTorch rounds them:
  equal to the eager code bit for bit.
- ``rms_norm``, ``add_rms_norm``: float32 and bfloat16, equal to the eager code bit for bit:
  the sum of squares is added in the order of ATen's CPU sum kernel, whose vector width
  ``install`` finds by comparing with torch (``sum_lanes``). Where neither width reproduces
  torch (another build or CPU), float32 keeps the eager code.
- ``qk_norm_rotary``: bfloat16, and float32 where the norms are PyTorch's (above).
- ``silu_and_mul``: bfloat16, and float32 where ``install`` finds PyTorch's vector exponential
  in libtorch and the chunking of ATen's loop (``silu_chunk``): equal to ``F.silu(gate) * up``
  bit for bit. In bfloat16 the exponential is a polynomial of the kernel's own, so a result
  can differ by one bfloat16 unit where a float32 value sits on a rounding boundary.

Anything else (float16, a layout the kernel does not read: a row that is not contiguous, a
weight in another dtype) returns None, and the function runs as written in PyTorch.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from hitchllm_attention_cpu.compiler import load_fused_ops

_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}
# Vector widths of ATen's float32 sum kernels (AVX2, AVX-512 builds), in the order tried.
_LANE_CANDIDATES = (8, 16)
# Row widths that tell the orders apart (under one vector, odd tails, several cascade levels).
_PROBE_WIDTHS = (7, 13, 192, 1031, 4099)
_norm_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)
_silu_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)
# Elements per chunk of ATen's vectorized loop (two vectors: AVX-512, AVX2), in the order tried.
_SILU_CHUNK_CANDIDATES = (32, 16)
# Row widths that tell the chunkings apart (a row under one chunk, odd tails).
_SILU_PROBE_WIDTHS = (7, 31, 47, 100, 512)
# Sleef's float32 exponential in libtorch, by vector width.
_SLEEF_EXP = {16: "Sleef_expf16_u10", 8: "Sleef_expf8_u10"}
#: ATen's GRAIN_SIZE: a sum with one output over this many values or more is split among
#: threads, and so is an elementwise loop over more values.
SPLIT_ROW = 32768


@functools.cache
def sum_lanes() -> int | None:
    """The vector width with which fused_ops.c's RMSNorm equals PyTorch's eager RMSNorm bit for
    bit in float32 on random rows of the probe widths (each candidate tried, the match left set
    in the library), or None where none does. Once per process (like the library): the answer
    depends only on torch's build and the CPU, and trying candidates changes the setting that
    the kernels of engines already running read."""
    functions = load_fused_ops().functions
    generator = torch.Generator().manual_seed(0)
    probes = [(torch.randn(3, n, generator=generator, dtype=torch.float32) * 10,
               torch.randn(n, generator=generator, dtype=torch.float32)) for n in _PROBE_WIDTHS]
    wants = [_eager_rms_norm(x, w) for x, w in probes]
    for lanes in _LANE_CANDIDATES:
        functions["hitch_set_sum_lanes"](lanes)
        if all(torch.equal(_c_rms_norm(x, w, 1e-6), want)
               for (x, w), want in zip(probes, wants, strict=True)):
            return lanes
    functions["hitch_set_sum_lanes"](_LANE_CANDIDATES[0])
    return None


@functools.cache
def silu_chunk() -> int | None:
    """The chunk length with which fused_ops.c's float32 SiLU-and-mul equals PyTorch's
    ``F.silu(gate) * up`` bit for bit on random rows (each candidate tried with libtorch's
    exponential, the match left set in the library), or None where none does or libtorch
    exports no exponential of the kernel's vector width (float32 SiLU then stays
    PyTorch's). Once per process, as ``sum_lanes`` (this probe also sets torch's thread count
    for a moment)."""
    from hitchllm_attention_cpu import torch_symbols

    functions = load_fused_ops().functions
    name = _SLEEF_EXP.get(functions["hitch_silu_exp_lanes"]())  # 0: built without AVX2
    exp = None if name is None else torch_symbols.address(name)
    if exp is None:
        return None
    generator = torch.Generator().manual_seed(0)
    probes = [torch.randn(3, 2 * n, generator=generator, dtype=torch.float32) * 8
              for n in _SILU_PROBE_WIDTHS]
    # Over SPLIT_ROW elements, checked at two threads: where ATen cuts the elements among
    # its threads, mid-row here (fused_ops.c reproduces the OpenMP backend's equal shares).
    split_probe = torch.randn(81, 2 * 509, generator=generator, dtype=torch.float32) * 8
    for chunk in _SILU_CHUNK_CANDIDATES:
        if functions["hitch_set_silu_exp"](exp, chunk) == 0 and all(
                torch.equal(_c_silu_and_mul(x), _eager_silu_and_mul(x)) for x in probes):
            threads = torch.get_num_threads()
            torch.set_num_threads(2)
            try:
                split_ok = torch.equal(_c_silu_and_mul(split_probe),
                                       _eager_silu_and_mul(split_probe))
            finally:
                torch.set_num_threads(threads)
            if split_ok:
                return chunk
            break  # the chunk is right; the thread split is not this torch's
    functions["hitch_set_silu_exp"](None, _SILU_CHUNK_CANDIDATES[0])
    return None


def _eager_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    width = x.shape[1] // 2
    return F.silu(x[:, :width]) * x[:, width:]


def _eager_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    from hitchllm.models import fused

    return fused._normalize(x, weight, 1e-6)


def _rows_ok(x: torch.Tensor) -> bool:
    """A [rows, ...] tensor whose rows are each contiguous (any row stride)."""
    return x.dim() >= 2 and x.stride(-1) == 1 and (
        x.dim() == 2 or (x.dim() == 3 and x.stride(1) == x.shape[2]))


def _like(x: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor of ``x``'s shape and dtype. ``x`` has contiguous rows in
    row-major order (``_rows_ok``), so ``empty_like``, which keeps the order of ``x``'s strides
    (or is contiguous when ``x`` is not dense), lays it out contiguously, in about 1 us against
    about 3 us for ``torch.empty(shape, dtype=...)`` (several calls a layer at decode sizes)."""
    return torch.empty_like(x)


def _c_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = _like(x)
    load_fused_ops().functions["hitch_rms_norm"](
        x.data_ptr(), x.stride(0), None, 0, None, weight.data_ptr(), out.data_ptr(),
        x.shape[0], x.shape[1], eps, _DTYPE_CODE[x.dtype], torch.get_num_threads())
    return out


def _norm_applies(x: torch.Tensor) -> bool:
    """The kernel takes ``x``'s dtype, and in float32 torch would sum each row on one thread
    (a single row of at least ``SPLIT_ROW`` values is summed in parts by several)."""
    return x.dtype in _norm_dtypes and not (
        x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] == 1
        and x.shape[1] >= SPLIT_ROW and torch.get_num_threads() > 1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    if not _norm_applies(x) or weight.dtype != x.dtype or x.dim() != 2 \
            or not _rows_ok(x) or not weight.is_contiguous():
        return None
    return _c_rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    if not _norm_applies(x) or residual.dtype != x.dtype or weight.dtype != x.dtype \
            or x.dim() != 2 or residual.shape != x.shape or not _rows_ok(x) \
            or not _rows_ok(residual) or not weight.is_contiguous():
        return None
    out, total = _like(x), _like(x)
    load_fused_ops().functions["hitch_rms_norm"](
        x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0), total.data_ptr(),
        weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps, _DTYPE_CODE[x.dtype],
        torch.get_num_threads())
    return out, total


def _c_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    width = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], width, dtype=gate_up.dtype)
    if load_fused_ops().functions["hitch_silu_and_mul"](
            gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), gate_up.shape[0], width,
            _DTYPE_CODE[gate_up.dtype], torch.get_num_threads(), torch.get_num_threads()) != 0:
        return None
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    if gate_up.dtype not in _silu_dtypes or gate_up.dim() != 2 or not _rows_ok(gate_up) \
            or gate_up.shape[1] % 2:
        return None
    return _c_silu_and_mul(gate_up)


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
    q_out, k_out = _like(q), _like(k)
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
    if q.dtype not in _norm_dtypes:
        return None
    return _rotary(positions, q, k, cos, sin, (q_weight, k_weight), eps)


KERNELS = {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "rotary": rotary,
           "qk_norm_rotary": qk_norm_rotary, "silu_and_mul": silu_and_mul}


def float32_exact() -> bool:
    """Whether every kernel takes float32 (PyTorch's results bit for bit): after
    ``install`` found both the norms' summation order and SiLU's exponential."""
    return torch.float32 in _norm_dtypes and torch.float32 in _silu_dtypes


def install() -> None:
    """Register the kernels for the CPU (builds fused_ops.c on first use; raises
    ``KernelBuildError`` when it cannot); the norms take float32 too where ``sum_lanes`` finds
    PyTorch's order, SiLU where ``silu_chunk`` finds PyTorch's exponential."""
    global _norm_dtypes, _silu_dtypes
    from hitchllm.models import fused

    _norm_dtypes = (torch.bfloat16,) if sum_lanes() is None else (torch.bfloat16, torch.float32)
    _silu_dtypes = (torch.bfloat16,) if silu_chunk() is None else (torch.bfloat16, torch.float32)
    fused.register_device_kernels("cpu", KERNELS)
