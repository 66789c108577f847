"""A Triton dequantize-and-multiply GEMM for AWQ int4 weights: ``out = x @ W.T``.

Each program owns a tile of the output and walks its share of the input dimension in steps of
``BLOCK_K``. Per step it loads the packed ``qweight`` tile (each int32 once), unpacks the eight
output columns of each int32 in registers (AWQ's interleaved nibble order, see
``awq_packing``), loads the group's zero points and scales, dequantizes in registers
as ``q * s - z * s`` in float32 (exact, like ``(q - z) * s``), and accumulates ``x @ W`` in
float32 (``tl.dot``, or elementwise products for GEMV). The int4 weight is read once from
memory; no float weight is written.

Three paths, each autotuned over a few tile shapes keyed by the batch's power-of-two bucket
and the layer's shape; ``select_path`` picks one by the batch's size:

- ``gemv`` (decode of one sequence): no tensor cores; one program
  per output row, column tile and K split multiplies elementwise into a float32
  ``[BLOCK_K, BLOCK_N]`` tile and reduces over K once at the end;
- ``split_k`` (``M <= SMALL_M``): ``tl.dot`` on 16-row tiles; few output tiles would leave the
  GPU idle, so the K range is split over ``SPLIT_K`` programs;
- ``tiles``: ``tl.dot`` on whole tiles, stored directly.

The first two add their partial sums into a zeroed float32 buffer (``tl.atomic_add``), cast
to ``x``'s dtype at the end. Autotuning runs on the first call of each bucket and shape, which
the engine makes eagerly before capturing CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hitchllm_quantization.awq_packing import PACK_FACTOR

GEMV_MAX_M = 1  # batches up to this size take the GEMV path
SMALL_M = 16  # batches up to this size take the split-K tensor-core path


@triton.jit
def _nibbles(words, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The 8 int4 values of each int32 of ``words`` (``[BLOCK_K, BLOCK_N // 8]``) as float32
    ``[BLOCK_K, BLOCK_N]``, in column order: column ``8c + j`` is nibble
    ``AWQ_REVERSE_ORDER[j] = j // 2 + (j % 2) * 4``."""
    j = tl.arange(0, 8)
    shifts = ((j // 2) + (j % 2) * 4) * 4
    values = (words[:, :, None] >> shifts[None, None, :]) & 0xF
    return tl.reshape(values, (BLOCK_K, BLOCK_N)).to(tl.float32)


@triton.jit
def _load_words(qweight_ptr, t, n0, N, K, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                valid=True):
    """The packed int32 ``[BLOCK_K, BLOCK_N // 8]`` of K tile ``t``, columns ``n0 ..``; zero
    outside ``[K, N]`` or when not ``valid``."""
    packed_n = N // 8
    rk = t * BLOCK_K + tl.arange(0, BLOCK_K)
    rc = n0 // 8 + tl.arange(0, BLOCK_N // 8)
    ok = (rk < K)[:, None] & (rc < packed_n)[None, :] & valid
    return tl.load(qweight_ptr + rk[:, None] * packed_n + rc[None, :], mask=ok, other=0)


@triton.jit
def _dequantize_tile(words, qzeros_ptr, scales_ptr, t, n0, N, K,
                     GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """K tile ``t``, columns ``n0 .. n0 + BLOCK_N`` of ``W.T`` in float32 from its packed
    ``words`` and the group's zero points and scales; zero outside ``[K, N]``."""
    packed_n = N // 8
    rk = t * BLOCK_K + tl.arange(0, BLOCK_K)
    rc = n0 // 8 + tl.arange(0, BLOCK_N // 8)  # packed columns
    rn = n0 + tl.arange(0, BLOCK_N)
    k_ok = rk < K
    q = _nibbles(words, BLOCK_K, BLOCK_N)
    if GROUP_SIZE % BLOCK_K == 0:  # the whole tile lies in one group: one row of each
        g = (t * BLOCK_K) // GROUP_SIZE
        zwords = tl.load(qzeros_ptr + g * packed_n + rc, mask=rc < packed_n, other=0)
        z = tl.reshape(_nibbles(zwords[None, :], 1, BLOCK_N), (BLOCK_N,))
        s = tl.load(scales_ptr + g * N + rn, mask=rn < N, other=0.0).to(tl.float32)
        w = q * s[None, :] - (z * s)[None, :]
    else:  # groups smaller than the tile: each row of the tile reads its group's row
        g = rk // GROUP_SIZE
        zwords = tl.load(qzeros_ptr + g[:, None] * packed_n + rc[None, :],
                         mask=k_ok[:, None] & (rc < packed_n)[None, :], other=0)
        s = tl.load(scales_ptr + g[:, None] * N + rn[None, :],
                    mask=k_ok[:, None] & (rn < N)[None, :], other=0.0)
        w = (q - _nibbles(zwords, BLOCK_K, BLOCK_N)) * s.to(tl.float32)
    return w


@triton.jit
def _split_k_tiles(K, pid_k, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """The K tiles ``first .. last - 1`` that K split ``pid_k`` of ``SPLIT_K`` walks."""
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    first = pid_k * per_split
    return first, tl.minimum(first + per_split, k_tiles)


@triton.jit
def awq_gemm_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_om, stride_on,
    M_BUCKET,  # unused: the autotuning key, M rounded up to a power of two
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, ATOMIC: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One ``[BLOCK_M, BLOCK_N]`` output tile over K-split ``program_id(2)`` with ``tl.dot``;
    ``ATOMIC`` adds into a zeroed float32 ``out`` instead of storing."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first, last = _split_k_tiles(K, pid_k, BLOCK_K, SPLIT_K)
    for t in range(first, last):
        rk = t * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk,
                    mask=(rm < M)[:, None] & (rk < K)[None, :], other=0.0)
        words = _load_words(qweight_ptr, t, pid_n * BLOCK_N, N, K, BLOCK_K, BLOCK_N)
        w = _dequantize_tile(words, qzeros_ptr, scales_ptr, t, pid_n * BLOCK_N, N, K,
                             GROUP_SIZE, BLOCK_K, BLOCK_N)
        acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION)
    out = out_ptr + rm[:, None] * stride_om + rn[None, :] * stride_on
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    if ATOMIC:
        tl.atomic_add(out, acc, mask=mask)
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def awq_gemv_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_om, stride_on,
    M_BUCKET,  # unused: the autotuning key, M rounded up to a power of two
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    """Row ``program_id(2)`` of the output, columns of tile ``program_id(0)``, K-split
    ``program_id(1)``, without tensor cores: products accumulate elementwise in a float32
    ``[BLOCK_K, BLOCK_N]`` tile, reduced over K once at the end and added into a zeroed
    float32 ``out``."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    first, last = _split_k_tiles(K, pid_k, BLOCK_K, SPLIT_K)
    n0 = pid_n * BLOCK_N
    # The weight loads are not pipelined by the compiler here (no tl.dot): prefetch the next
    # tile's words by hand so that two tiles' loads are in flight.
    words = _load_words(qweight_ptr, first, n0, N, K, BLOCK_K, BLOCK_N, first < last)
    for t in range(first, last):
        upcoming = _load_words(qweight_ptr, t + 1, n0, N, K, BLOCK_K, BLOCK_N, t + 1 < last)
        rk = t * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m * stride_xm + rk * stride_xk, mask=rk < K, other=0.0)
        w = _dequantize_tile(words, qzeros_ptr, scales_ptr, t, n0, N, K, GROUP_SIZE, BLOCK_K,
                             BLOCK_N)
        acc += x.to(tl.float32)[:, None] * w
        words = upcoming
    tl.atomic_add(out_ptr + m * stride_om + rn * stride_on, tl.sum(acc, axis=0), mask=rn < N)


def _config(split_k: int, warps: int, stages: int, **tile: int) -> triton.Config:
    return triton.Config({**tile, "SPLIT_K": split_k}, num_warps=warps, num_stages=stages)


GEMV_CONFIGS = [
    _config(split_k, warps, 1, BLOCK_N=n, BLOCK_K=k)
    for n, k, warps in ((64, 32, 4), (64, 64, 4), (128, 32, 4), (128, 64, 8), (256, 32, 8))
    for split_k in (2, 4, 8, 16)
]
SPLIT_K_CONFIGS = [
    _config(split_k, 4, stages, BLOCK_M=16, BLOCK_N=n, BLOCK_K=128)
    for n in (32, 64, 128) for split_k in (1, 2, 4, 8) for stages in (3, 4)
    if not (n == 128 and split_k == 1)
]
TILE_CONFIGS = [
    _config(1, warps, stages, BLOCK_M=m, BLOCK_N=n, BLOCK_K=k)
    for m, n, k, warps, stages in (
        (32, 64, 128, 4, 4), (64, 64, 64, 4, 4), (64, 128, 64, 4, 3), (64, 128, 128, 8, 3),
        (128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (128, 256, 64, 8, 3),
    )
]


def _keep_whole_groups(configs: list[triton.Config], named_args: dict, **kwargs) -> list:
    """Prefer tiles that lie in one quantization group (the fast branch of the kernel)."""
    group = named_args.get("GROUP_SIZE", kwargs.get("GROUP_SIZE"))
    whole = [c for c in configs if group % c.kwargs["BLOCK_K"] == 0]
    return whole or configs


def _autotuned(kernel, configs: list[triton.Config], atomic: bool):
    return triton.autotune(
        configs=configs, key=["M_BUCKET", "N", "K", "GROUP_SIZE"],
        prune_configs_by={"early_config_prune": _keep_whole_groups},
        reset_to_zero=["out_ptr"] if atomic else None,
    )(kernel)


PATHS = {  # name -> (kernel, autotuned kernel, adds into a float32 buffer)
    "gemv": (awq_gemv_kernel, _autotuned(awq_gemv_kernel, GEMV_CONFIGS, True), True),
    "split_k": (awq_gemm_kernel, _autotuned(awq_gemm_kernel, SPLIT_K_CONFIGS, True), True),
    "tiles": (awq_gemm_kernel, _autotuned(awq_gemm_kernel, TILE_CONFIGS, False), False),
}


def select_path(m: int) -> str:
    """The kernel path for a batch of ``m`` rows: ``gemv`` for one, ``split_k`` up to
    ``SMALL_M``, ``tiles`` above. A fixed rule from H100 measurements with cold weights
    (benchmarks/quant_awq.py): the GEMV wins only at one row (32 vs 42 us at 4096 x 14336) and
    loses from two rows on, at every Llama-8B shape. An earlier version timed both paths on
    first use instead, but a one-off timing reads the weight from the L2 cache, not from memory
    as a served model does, and picked the slower path."""
    if m > SMALL_M:
        return "tiles"
    return "gemv" if m <= GEMV_MAX_M else "split_k"


def awq_gemm(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
    group_size: int, config: dict[str, int] | None = None, path: str | None = None,
) -> torch.Tensor:
    """``x @ W.T`` (``x`` ``[M, K]``; AWQ tensors of ``W`` ``[N, K]``) in ``x``'s dtype.

    ``path`` picks the kernel (``select_path`` when None); ``config`` fixes its tile
    (``BLOCK_N``, ``BLOCK_K``, ``SPLIT_K``, ``BLOCK_M`` except for ``gemv``, optional
    ``num_warps``/``num_stages``) instead of autotuning: tests use it to run every path under
    the Triton interpreter, the benchmark to compare paths."""
    m, k = x.shape
    n = qweight.shape[1] * PACK_FACTOR
    if qweight.shape[0] != k:
        raise ValueError(f"x has {k} input columns but qweight has {qweight.shape[0]} rows")
    path = path or select_path(m)
    kernel, tuned, atomic = PATHS[path]
    out = (torch.zeros(m, n, dtype=torch.float32, device=x.device) if atomic
           else torch.empty(m, n, dtype=x.dtype, device=x.device))
    args = (x, qweight, qzeros, scales, out, m, n, k, x.stride(0), x.stride(1), out.stride(0),
            out.stride(1), triton.next_power_of_2(m))
    flags = {"GROUP_SIZE": group_size}
    if path != "gemv":
        flags |= {"ATOMIC": atomic,
                  "DOT_PRECISION": "ieee" if x.dtype == torch.float32 else "tf32"}

    def grid(meta: dict) -> tuple[int, int, int]:
        if path == "gemv":
            return triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"], m
        return triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"]

    if config is None:
        tuned[grid](*args, **flags)
    else:
        launch = {"num_warps": 4, "num_stages": 2} | config
        kernel[grid(launch)](*args, **flags, **launch)
    return out.to(x.dtype) if atomic else out
