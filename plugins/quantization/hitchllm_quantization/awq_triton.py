"""A Triton dequantize-and-multiply GEMM for AWQ int4 weights: ``out = x @ W.T``.

Each program owns a ``[BLOCK_M, BLOCK_N]`` tile of the output and walks its share of the input
dimension in steps of ``BLOCK_K``. Per step it loads the packed ``qweight`` tile (each int32
read by the eight output columns it holds), extracts every column's nibble (AWQ's interleaved
order, see ``awq_packing``), loads the group's zero points and scales, dequantizes in registers
as ``q * s - z * s`` in float32 (exact, like ``(q - z) * s``), and accumulates ``x @ W`` with
``tl.dot`` in float32. The int4 weight is read once from memory; nothing float is written.

Small batches (``M <= 16``, decode) leave too few output tiles to fill the GPU, so they split
the input dimension over ``SPLIT_K`` programs that add their partial sums into a float32
buffer (``tl.atomic_add``); larger batches store their tile directly. Both paths autotune over
a few tile shapes, keyed by the batch size's power-of-two bucket and the layer's shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hitchllm_quantization.awq_packing import PACK_FACTOR

SMALL_M = 16  # batches up to this size take the split-K path


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
    """One ``[BLOCK_M, BLOCK_N]`` output tile over K-split ``program_id(2)``; ``ATOMIC`` adds
    into a zeroed float32 ``out`` instead of storing."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    packed_n = N // 8
    word = rn // 8
    # Column 8c + j sits in nibble AWQ_REVERSE_ORDER[j] = j // 2 + (j % 2) * 4.
    j = rn % 8
    shifts = ((j // 2) + (j % 2) * 4) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    first = pid_k * per_split
    last = tl.minimum(first + per_split, k_tiles)
    for t in range(first, last):
        rk = t * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wk_ok = k_ok[:, None] & n_ok[None, :]
        words = tl.load(qweight_ptr + rk[:, None] * packed_n + word[None, :], mask=wk_ok,
                        other=0)
        q = ((words >> shifts[None, :]) & 0xF).to(tl.float32)
        if GROUP_SIZE % BLOCK_K == 0:  # the whole tile lies in one group: one row of each
            g = (t * BLOCK_K) // GROUP_SIZE
            zwords = tl.load(qzeros_ptr + g * packed_n + word, mask=n_ok, other=0)
            s = tl.load(scales_ptr + g * N + rn, mask=n_ok, other=0.0).to(tl.float32)
            zs = ((zwords >> shifts) & 0xF).to(tl.float32) * s
            w = q * s[None, :] - zs[None, :]
        else:  # groups smaller than the tile: each row of the tile reads its group's row
            g = rk // GROUP_SIZE
            zwords = tl.load(qzeros_ptr + g[:, None] * packed_n + word[None, :], mask=wk_ok,
                             other=0)
            s = tl.load(scales_ptr + g[:, None] * N + rn[None, :], mask=wk_ok,
                        other=0.0).to(tl.float32)
            w = (q - ((zwords >> shifts[None, :]) & 0xF).to(tl.float32)) * s
        acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION)
    out = out_ptr + rm[:, None] * stride_om + rn[None, :] * stride_on
    mask = m_ok[:, None] & n_ok[None, :]
    if ATOMIC:
        tl.atomic_add(out, acc, mask=mask)
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _config(m: int, n: int, k: int, split_k: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": split_k},
                         num_warps=warps, num_stages=stages)


SMALL_M_CONFIGS = [
    _config(16, n, 128, split_k, 4, stages)
    for n in (32, 64, 128) for split_k in (1, 2, 4, 8) for stages in (3, 4)
    if not (n == 128 and split_k == 1)
]
LARGE_M_CONFIGS = [
    _config(m, n, k, 1, warps, stages)
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


_small_m_kernel = triton.autotune(
    configs=SMALL_M_CONFIGS, key=["M_BUCKET", "N", "K", "GROUP_SIZE"],
    prune_configs_by={"early_config_prune": _keep_whole_groups}, reset_to_zero=["out_ptr"],
)(awq_gemm_kernel)
_large_m_kernel = triton.autotune(
    configs=LARGE_M_CONFIGS, key=["M_BUCKET", "N", "K", "GROUP_SIZE"],
    prune_configs_by={"early_config_prune": _keep_whole_groups},
)(awq_gemm_kernel)


def awq_gemm(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
    group_size: int, config: dict[str, int] | None = None,
) -> torch.Tensor:
    """``x @ W.T`` (``x`` ``[M, K]``; AWQ tensors of ``W`` ``[N, K]``) in ``x``'s dtype.

    ``config`` fixes the tile (``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``, ``SPLIT_K``, optional
    ``num_warps``/``num_stages``) instead of autotuning: tests use it to run every path under
    the Triton interpreter."""
    m, k = x.shape
    n = qweight.shape[1] * PACK_FACTOR
    if qweight.shape[0] != k:
        raise ValueError(f"x has {k} input columns but qweight has {qweight.shape[0]} rows")
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    small = m <= SMALL_M if config is None else config.get("SPLIT_K", 1) > 1
    out = (torch.zeros(m, n, dtype=torch.float32, device=x.device) if small
           else torch.empty(m, n, dtype=x.dtype, device=x.device))
    args = (x, qweight, qzeros, scales, out, m, n, k, x.stride(0), x.stride(1), out.stride(0),
            out.stride(1), triton.next_power_of_2(m))
    if config is None:
        kernel = _small_m_kernel if small else _large_m_kernel

        def grid(meta: dict) -> tuple[int, int, int]:
            return (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]),
                    meta["SPLIT_K"])

        kernel[grid](*args, GROUP_SIZE=group_size, ATOMIC=small, DOT_PRECISION=precision)
    else:
        tile = {key: config[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K")}
        grid3 = (triton.cdiv(m, tile["BLOCK_M"]), triton.cdiv(n, tile["BLOCK_N"]),
                 tile["SPLIT_K"])
        awq_gemm_kernel[grid3](*args, GROUP_SIZE=group_size, ATOMIC=small,
                               DOT_PRECISION=precision, num_warps=config.get("num_warps", 4),
                               num_stages=config.get("num_stages", 2), **tile)
    return out.to(x.dtype) if small else out
