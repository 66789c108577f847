"""Triton kernels for AWQ int4 weights: ``out = x @ W.T``.

The kernels read the weight in the K-packed layout of ``awq_packing.pack_along_k`` (made once
at load from AWQ's GEMM packing): int32 ``[K // 8, N]`` whose nibble ``i`` of word ``[r, n]``
is ``q[8r + i, n]``, with zero points as uint8 ``[K // G, N]`` and AWQ's float16 scales. A
word's eight values then share one output column and one quantization group.

Four paths; ``select_path`` picks one by the batch's size:

- ``gemv`` (one row, decode of one sequence): no tensor cores. Nibble ``i`` of a whole tile
  of words is one shift and one ``lop3`` away from a float (``_nibble_floats`` puts it in
  mantissa bits 19-22 of ``1.0``, which reads ``1 + q / 16``; no conversion instruction, which
  runs at a quarter of the FMA rate), and per group ``sum_k x_k (q_k - z) s = s (16 P -
  (16 + z) X)`` with ``P = sum_k x_k (1 + q_k / 16)`` and ``X = sum_k x_k``: one FMA per int4
  value, zero point and scale once per word row and column. Wide, short tiles let a warp share
  its ``x`` loads; a program owns ``BLOCK_N`` columns and a share of the groups (``SPLIT_K``).
- ``split_k`` (a few rows): each ``BLOCK_K`` tile is dequantized nibble by nibble into eight
  ``[BLOCK_K // 8, BLOCK_N]`` slices in ``x``'s dtype, each multiplied with ``tl.dot`` by the
  matching strided columns of ``x``; the K range is split so that the GPU fills.
- ``tiles`` (tens of rows): the tile's eight nibbles are dequantized together and merged into
  one ``[BLOCK_K, BLOCK_N]`` tile in input order, one ``tl.dot`` per tile.
- ``dequantize`` (hundreds of rows and more, prompts): the float weight is written once and
  multiplied by ``F.linear``.

The GEMV's tile follows a rule of the layer's shape (``gemv_config``); the dot kernels are
autotuned over a few tiles keyed by the batch's power-of-two bucket and the layer's shape, on
the first call of each, which the engine makes eagerly before capturing CUDA graphs. With
``SPLIT_K > 1`` programs add their partial sums into a zeroed float32 buffer
(``tl.atomic_add``), cast to ``x``'s dtype at the end; otherwise they store directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hitchllm_quantization.awq_packing import PACK_FACTOR

GEMV_MAX_M = 1  # batches up to this size take the GEMV path
SMALL_M = 8  # then the sliced dot kernel with K splits, up to this size
TILES_MAX_M = 64  # then the merged-tile dot kernel, up to this size; above, F.linear


@triton.jit
def _nibble_floats(words, NIBBLE: tl.constexpr, PTX: tl.constexpr):
    """``1 + q / 16`` in float32 for nibble ``NIBBLE`` (bits ``4 NIBBLE .. 4 NIBBLE + 3``) of
    each of ``words``: the nibble moved to the top mantissa bits 19-22 (``0x780000``) of
    ``1.0`` (``0x3F800000``), so that recovering ``q`` costs 4 of float32's 24 bits. With
    ``PTX`` (on a GPU) the mask and the ``or`` are one ``lop3`` instruction, which the
    compiler does not fuse by itself."""
    if 4 * NIBBLE <= 19:  # noqa: SIM108 (Triton compiles if-blocks on constexprs)
        moved = words << (19 - 4 * NIBBLE)
    else:
        moved = words >> (4 * NIBBLE - 19)
    if PTX:
        bits = tl.inline_asm_elementwise(
            "lop3.b32 $0, $1, 0x780000, 0x3F800000, 0xEA;", "=r,r", [moved],
            dtype=tl.int32, is_pure=True, pack=1)
    else:
        bits = (moved & 0x780000) | 0x3F800000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _split_k_tiles(K, pid_k, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """The K tiles ``first .. last - 1`` that K split ``pid_k`` of ``SPLIT_K`` walks."""
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    first = pid_k * per_split
    return first, tl.minimum(first + per_split, k_tiles)


@triton.jit
def _load_words(qweight_ptr, t, rn, N, K, BLOCK_K: tl.constexpr, valid=True):
    """Word rows of K tile ``t`` (``[BLOCK_K // 8, len(rn)]`` int32), columns ``rn``; zero
    outside ``[K // 8, N]`` or when not ``valid``."""
    rr = t * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    ok = (rr < K // 8)[:, None] & (rn < N)[None, :] & valid
    return tl.load(qweight_ptr + rr[:, None] * N + rn[None, :], mask=ok, other=0)


@triton.jit
def _group_scales(zeros_ptr, scales_ptr, t, rn, N, K, GROUP_SIZE: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """``(16 s, (16 + z) s)`` in float32 for the columns ``rn`` of K tile ``t``: ``[1,
    len(rn)]`` when the tile lies in one group, else ``[BLOCK_K // 8, len(rn)]``, each word
    row its group's (a word never straddles groups: the group size is a multiple of 8)."""
    if GROUP_SIZE % BLOCK_K == 0:
        g = tl.full((1,), (t * BLOCK_K) // GROUP_SIZE, tl.int32)
        ok = (rn < N)[None, :]
    else:
        k8 = 8 * (t * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8))
        g = k8 // GROUP_SIZE
        ok = (k8 < K)[:, None] & (rn < N)[None, :]
    s = tl.load(scales_ptr + g[:, None] * N + rn[None, :], mask=ok, other=0.0).to(tl.float32)
    z = tl.load(zeros_ptr + g[:, None] * N + rn[None, :], mask=ok, other=0).to(tl.float32)
    return 16.0 * s, (16.0 + z) * s


@triton.jit
def awq_gemv_kernel(
    x_ptr, qweight_ptr, zeros_ptr, scales_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_om, stride_on,
    M_BUCKET,  # unused: the autotuning key, M rounded up to a power of two
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PTX: tl.constexpr,
):
    """Row ``program_id(2)`` of the output, columns of tile ``program_id(0)``, the groups of
    K split ``program_id(1)``, without tensor cores. Tiles are wide and short (``BLOCK_K`` a
    divisor of the group size): a warp's threads share their word rows, so each ``x`` value
    is one load for the whole warp, and scale and zero point apply once per group."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
    part = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
    x_sum = tl.zeros((BLOCK_K // 8,), dtype=tl.float32)
    TILES_PER_GROUP: tl.constexpr = GROUP_SIZE // BLOCK_K
    groups = tl.cdiv(K, GROUP_SIZE)
    per_split = tl.cdiv(groups, SPLIT_K)
    first = pid_k * per_split * TILES_PER_GROUP
    last = tl.minimum((pid_k + 1) * per_split, groups) * TILES_PER_GROUP
    x_row = x_ptr + m * stride_xm
    # Loads that no tl.dot consumes are not pipelined by the compiler: fetch the next tile's
    # words by hand so that two tiles' loads are in flight.
    words = _load_words(qweight_ptr, first, rn, N, K, BLOCK_K, first < last)
    for t in range(first, last):
        upcoming = _load_words(qweight_ptr, t + 1, rn, N, K, BLOCK_K, t + 1 < last)
        k8 = 8 * (t * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8))  # first k of each word row
        k_ok = k8 < K
        for i in tl.static_range(8):
            xi = tl.load(x_row + (k8 + i) * stride_xk, mask=k_ok, other=0.0).to(tl.float32)
            part += xi[:, None] * _nibble_floats(words, i, PTX)
            x_sum += xi
        if t % TILES_PER_GROUP == TILES_PER_GROUP - 1:  # the group's last tile
            s16, zs = _group_scales(zeros_ptr, scales_ptr, t, rn, N, K, GROUP_SIZE, BLOCK_K)
            acc += s16 * part - zs * x_sum[:, None]
            part = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
            x_sum = tl.zeros((BLOCK_K // 8,), dtype=tl.float32)
        words = upcoming
    out = out_ptr + m * stride_om + rn * stride_on
    if SPLIT_K > 1:
        tl.atomic_add(out, tl.sum(acc, axis=0), mask=rn < N)
    else:
        tl.store(out, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def _output_tile(K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr):
    """Rows and columns of the dot kernels' output tile ``(program_id(0), program_id(1))``
    and the K tiles ``first .. last - 1`` of split ``program_id(2)``."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    first, last = _split_k_tiles(K, tl.program_id(2), BLOCK_K, SPLIT_K)
    return rm, rn, first, last


@triton.jit
def _store_tile(out_ptr, acc, rm, rn, M, N, stride_om, stride_on, SPLIT_K: tl.constexpr):
    """Write a dot kernel's ``acc``: added into the float32 buffer when K is split, else
    stored in ``out``'s dtype."""
    out = out_ptr + rm[:, None] * stride_om + rn[None, :] * stride_on
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    if SPLIT_K > 1:
        tl.atomic_add(out, acc, mask=mask)
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def awq_dot_kernel(
    x_ptr, qweight_ptr, zeros_ptr, scales_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_om, stride_on,
    M_BUCKET,  # unused: the autotuning key, M rounded up to a power of two
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, DOT_PRECISION: tl.constexpr, PTX: tl.constexpr,
):
    """One ``[BLOCK_M, BLOCK_N]`` output tile over K split ``program_id(2)`` with ``tl.dot``
    (``BLOCK_K`` at least 128, so that each slice has the 16 rows ``tl.dot`` needs)."""
    rm, rn, first, last = _output_tile(K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_rows = x_ptr + rm[:, None] * stride_xm
    for t in range(first, last):
        words = _load_words(qweight_ptr, t, rn, N, K, BLOCK_K)
        k8 = 8 * (t * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8))
        x_ok = (rm < M)[:, None] & (k8 < K)[None, :]
        s16, zs = _group_scales(zeros_ptr, scales_ptr, t, rn, N, K, GROUP_SIZE, BLOCK_K)
        for i in tl.static_range(8):
            xi = tl.load(x_rows + (k8 + i)[None, :] * stride_xk, mask=x_ok, other=0.0)
            w = _nibble_floats(words, i, PTX) * s16 - zs  # (q - z) s
            acc += tl.dot(xi, w.to(xi.dtype), input_precision=DOT_PRECISION)
    _store_tile(out_ptr, acc, rm, rn, M, N, stride_om, stride_on, SPLIT_K)


@triton.jit
def awq_tiles_kernel(
    x_ptr, qweight_ptr, zeros_ptr, scales_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_om, stride_on,
    M_BUCKET,  # unused: the autotuning key, M rounded up to a power of two
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, DOT_PRECISION: tl.constexpr, PTX: tl.constexpr,
):
    """One ``[BLOCK_M, BLOCK_N]`` output tile over K split ``program_id(2)`` with one
    ``tl.dot`` per ``BLOCK_K`` tile: all eight nibbles of the tile's words are dequantized
    together (``[BLOCK_K // 8, 8, BLOCK_N]``, word row by nibble) and merged into the
    ``[BLOCK_K, BLOCK_N]`` tile in input order, for batches whose multiply outweighs the
    unpacking (``PTX`` is unused)."""
    rm, rn, first, last = _output_tile(K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    shifts = 4 * tl.arange(0, 8)
    for t in range(first, last):
        words = _load_words(qweight_ptr, t, rn, N, K, BLOCK_K)
        k = t * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :] * stride_xk,
                    mask=(rm < M)[:, None] & (k < K)[None, :], other=0.0)
        s16, zs = _group_scales(zeros_ptr, scales_ptr, t, rn, N, K, GROUP_SIZE, BLOCK_K)
        q = ((words[:, None, :] >> shifts[None, :, None]) & 0xF).to(tl.float32)
        w = q * (s16 / 16.0)[:, None, :] - (zs - s16)[:, None, :]  # (q - z) s
        w = tl.reshape(w, (BLOCK_K, BLOCK_N))
        acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION)
    _store_tile(out_ptr, acc, rm, rn, M, N, stride_om, stride_on, SPLIT_K)


@triton.jit
def awq_dequantize_kernel(qweight_ptr, zeros_ptr, scales_ptr, w_ptr, N, K,
                          GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    """``W[n, k]`` (``[N, K]``, ``w``'s dtype) of K tile ``program_id(0)``, columns of tile
    ``program_id(1)``: each word's eight values are eight consecutive ``k`` of one row."""
    t = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    words = _load_words(qweight_ptr, t, rn, N, K, BLOCK_K)
    s16, zs = _group_scales(zeros_ptr, scales_ptr, t, rn, N, K, GROUP_SIZE, BLOCK_K)
    nibble = tl.arange(0, 8)
    q = ((words[:, :, None] >> (4 * nibble)[None, None, :]) & 0xF).to(tl.float32)
    w = q * (s16 / 16.0)[:, :, None] - (zs - s16)[:, :, None]  # (q - z) s
    rr = t * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    ptrs = w_ptr + rn[None, :, None] * K + (8 * rr)[:, None, None] + nibble[None, None, :]
    ok = (rr < K // 8)[:, None, None] & (rn < N)[None, :, None]
    tl.store(ptrs, w.to(w_ptr.dtype.element_ty), mask=ok)


def _config(split_k: int, warps: int, stages: int, **tile: int) -> triton.Config:
    return triton.Config({**tile, "SPLIT_K": split_k}, num_warps=warps, num_stages=stages)


SMALL_DOT_CONFIGS = [
    _config(split_k, 4, stages, BLOCK_M=16, BLOCK_N=n, BLOCK_K=128)
    for n in (64, 128) for split_k in (4, 8) for stages in (2, 3)
]
TILE_CONFIGS = SMALL_DOT_CONFIGS + [
    _config(1, warps, stages, BLOCK_M=m, BLOCK_N=n, BLOCK_K=k)
    for m, n, k, warps, stages in (
        (64, 128, 128, 4, 3), (128, 128, 128, 8, 3), (64, 64, 128, 4, 3), (32, 64, 128, 4, 3),
        (128, 128, 64, 8, 3),
    )
]


def gemv_config(n: int, k: int, group_size: int) -> dict[str, int]:
    """The GEMV's tile for an ``N x K`` layer: 512 columns (256 below 4096 outputs), 32 input
    rows (4 words) a step, and one or two groups per K split, so that a Llama-8B layer runs
    256-896 programs. A fixed rule, not autotuned: the best tile with the weight read from
    memory (benchmarks/quant_awq.py, cold weights) is not the best with it in the L2 cache,
    where a first-use timing would find it. Measured on an H100, cold, M = 1 (the best of 50
    tiles in brackets): 4096 x 14336 19.8 us (19.8), 14336 x 4096 20.6 (20.2), 4096 x 4096
    10.6 (10.6), 4096 x 6144 12.0 (12.0)."""
    return {"BLOCK_N": 512 if n >= 4096 else 256, "BLOCK_K": min(32, group_size),
            "SPLIT_K": max(1, min(k // group_size, 64)), "num_warps": 4, "num_stages": 1}


def _autotuned(kernel, configs: list[triton.Config], atomic: bool):
    return triton.autotune(configs=configs, key=["M_BUCKET", "N", "K", "GROUP_SIZE"],
                           reset_to_zero=["out_ptr"] if atomic else None)(kernel)


PATHS = {  # name -> (kernel, autotuned kernel; None: a tile of its own rule)
    "gemv": (awq_gemv_kernel, None),
    "split_k": (awq_dot_kernel, _autotuned(awq_dot_kernel, SMALL_DOT_CONFIGS, True)),
    "tiles": (awq_tiles_kernel, _autotuned(awq_tiles_kernel, TILE_CONFIGS, True)),
    "dequantize": (awq_dequantize_kernel, None),
}
DEQUANTIZE_TILE = {"BLOCK_N": 64, "BLOCK_K": 64}  # 54-56 us for 4096 x 14336 on an H100


def select_path(m: int) -> str:
    """The kernel path for a batch of ``m`` rows. A fixed rule from H100 measurements with
    cold weights (benchmarks/quant_awq.py; a one-off timing on first use would read the weight
    from the L2 cache, not from memory as a served model does): ``gemv`` for one row;
    ``split_k`` (eight 16-row dots a tile) up to ``SMALL_M``; ``tiles`` (one merged dot a tile)
    up to ``TILES_MAX_M``; above, ``dequantize`` writes the float weight once and multiplies
    with ``F.linear``, whose GEMM outruns dequantizing inside the multiply from a few hundred
    rows on (4096 x 14336 at 512 rows: 146 against 206 us; 2048 rows: 0.86x bf16's time)."""
    if m <= GEMV_MAX_M:
        return "gemv"
    if m <= SMALL_M:
        return "split_k"
    return "tiles" if m <= TILES_MAX_M else "dequantize"


def dequantize_weight(qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                      group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The float weight ``W`` ``[N, K]`` in ``dtype`` from the K-packed tensors."""
    n, k = qweight.shape[1], qweight.shape[0] * PACK_FACTOR
    weight = torch.empty(n, k, dtype=dtype, device=qweight.device)
    tile = DEQUANTIZE_TILE
    grid = (triton.cdiv(k, tile["BLOCK_K"]), triton.cdiv(n, tile["BLOCK_N"]))
    awq_dequantize_kernel[grid](qweight, zeros, scales, weight, n, k, GROUP_SIZE=group_size,
                                **tile, num_warps=4)
    return weight


def awq_gemm(
    x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
    group_size: int, config: dict[str, int] | None = None, path: str | None = None,
) -> torch.Tensor:
    """``x @ W.T`` (``x`` ``[M, K]``) in ``x``'s dtype, from the K-packed tensors of ``W``
    ``[N, K]`` (``awq_packing.pack_along_k``: ``qweight`` int32 ``[K // 8, N]``, ``zeros``
    uint8 ``[K // G, N]``) and AWQ's ``scales`` ``[K // G, N]``.

    ``path`` picks the kernel (``select_path`` when None); ``config`` fixes its tile
    (``BLOCK_N``, ``BLOCK_K``, ``SPLIT_K``, ``BLOCK_M`` except for ``gemv``, optional
    ``num_warps``/``num_stages``) instead of autotuning: tests use it to run every path under
    the Triton interpreter, the benchmark to compare paths."""
    m, k = x.shape
    n = qweight.shape[1]
    if qweight.shape[0] * PACK_FACTOR != k:
        raise ValueError(f"x has {k} input columns but qweight packs "
                         f"{qweight.shape[0] * PACK_FACTOR}")
    path = path or select_path(m)
    if path == "dequantize":
        return F.linear(x, dequantize_weight(qweight, zeros, scales, group_size, x.dtype))
    kernel, tuned = PATHS[path]
    if path == "gemv" and config is not None and group_size % config["BLOCK_K"]:
        raise ValueError(f"the GEMV's BLOCK_K {config['BLOCK_K']} must divide the group size "
                         f"{group_size}")
    if path == "gemv" and config is None:
        config = gemv_config(n, k, group_size)
    # Autotuned paths may pick a K split: they always get a float32 buffer.
    atomic = config is None or config["SPLIT_K"] > 1
    out = (torch.zeros(m, n, dtype=torch.float32, device=x.device) if atomic
           else torch.empty(m, n, dtype=x.dtype, device=x.device))
    args = (x, qweight, zeros, scales, out, m, n, k, x.stride(0), x.stride(1), out.stride(0),
            out.stride(1), triton.next_power_of_2(m))
    flags = {"GROUP_SIZE": group_size, "PTX": x.is_cuda}
    if path != "gemv":
        flags["DOT_PRECISION"] = "ieee" if x.dtype == torch.float32 else "tf32"

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
