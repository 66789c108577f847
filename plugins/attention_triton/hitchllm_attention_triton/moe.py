"""The fused mixture-of-experts kernel: (token, k) pairs sorted by expert into row blocks,
then two grouped GEMMs over the blocks, each block multiplying by its one expert's weights.

1. ``moe_align`` (torch ops, no host synchronization, output shapes fixed by the input's
   shape, hence safe to capture in a CUDA graph) sorts the ``T * k`` pairs by expert and pads
   each expert's run to a multiple of ``block_m`` rows: ``sorted_ids`` (flat pair index
   ``t * k + j``, ``T * k`` in padding rows), ``block_expert`` (the expert of each block) and
   ``num_padded`` (a one-element device tensor: the rows in use; blocks past it exit at once).
2. ``_moe_gemm_kernel`` computes, for one block of rows and one tile of output columns,
   ``A[rows] @ W[expert].T``. The first launch gathers the hidden rows (``pair // k``) and
   reads both the gate and the up rows of ``w13``, writing ``silu(gate) * up`` per pair; the
   second reads those per-pair rows, multiplies by ``w2`` and scales each row by its top-k
   weight in the epilogue. The ``k`` outputs of a token are then summed (in float32).

``TritonMoEMethod`` keeps ``UnquantizedMoEMethod``'s weights (``w13_weight [E, 2I, H]``,
``w2_weight [E, H, I]``) and replaces its ``apply``; the plugin installs it on CUDA (see
``plugin.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import nn

from hitchllm.layers import UnquantizedMoEMethod

__all__ = ["MoEAlignment", "TritonMoEMethod", "fused_moe", "moe_align"]


@dataclass(frozen=True)
class MoEAlignment:
    """The (token, k) pairs sorted by expert in blocks of ``block_m`` rows."""

    sorted_ids: torch.Tensor  # [max_rows] int32: pair index t * k + j, or T * k (padding)
    block_expert: torch.Tensor  # [max_rows // block_m] int32: the expert of each block
    num_padded: torch.Tensor  # [1] int32: rows in use (a multiple of block_m)
    block_m: int


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """Sort the pairs of ``topk_ids [T, k]`` by expert (stable: by pair index within an
    expert), each expert's run padded to a multiple of ``block_m`` rows; experts without
    tokens get no block. Output sizes depend only on ``T * k``, ``num_experts`` and
    ``block_m`` (at most ``T * k + num_experts * (block_m - 1)`` rows, rounded up to a
    block), and nothing is read back to the host."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [tokens, top_k], got shape {tuple(topk_ids.shape)}")
    if block_m <= 0:
        raise ValueError(f"block_m must be positive, got {block_m}")
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    pairs = flat.numel()
    max_rows = -(-(pairs + num_experts * (block_m - 1)) // block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    # Sorted position i of expert e's run goes to row i + (padded start - unpadded start of e).
    shift = padded_ends - padded - (counts.cumsum(0) - counts)
    sorted_experts, order = torch.sort(flat, stable=True)
    rows = torch.arange(pairs, device=device) + shift[sorted_experts]
    sorted_ids = torch.full((max_rows,), pairs, dtype=torch.int32, device=device)
    sorted_ids[rows] = order.to(torch.int32)
    block_rows = torch.arange(0, max_rows, block_m, device=device)
    block_expert = torch.searchsorted(padded_ends, block_rows, right=True)
    # Blocks past the last expert's run are skipped by the kernel; keep their index in range.
    block_expert = block_expert.clamp(max=num_experts - 1).to(torch.int32)
    return MoEAlignment(sorted_ids, block_expert, padded_ends[-1:].to(torch.int32), block_m)


@triton.jit
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
    N, K, num_pairs, a_row_div,
    stride_am, stride_be, stride_bn, stride_bk, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GATED: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, IEEE: tl.constexpr,
):
    """C[pair, n] for one block of sorted pairs and one tile of columns: A's row
    ``pair // a_row_div`` times ``B[expert, n, :]``; with GATED, ``silu(gate) * up`` where the
    up row is ``B[expert, N + n, :]``; with MUL_ROUTED_WEIGHT, scaled by ``weights[pair]``."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    block = pid // tiles_n
    pid_n = pid % tiles_n
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pair = tl.load(sorted_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = pair < num_pairs
    a_row = pair // a_row_div
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        if GATED:
            b_up = tl.load(b_ptrs + N * stride_bn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if IEEE:
                acc_up += tl.dot(a, b_up, input_precision="ieee")
            else:
                acc_up += tl.dot(a, b_up)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(weights_ptr + pair, mask=row_ok, other=0.0)
        acc = acc * weight[:, None]
    c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class _Tiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int


def _tiles(num_pairs: int, num_experts: int) -> _Tiles:
    """Row blocks about as tall as an expert's share of the pairs (little padding at decode,
    full tensor-core tiles at prefill)."""
    per_expert = num_pairs / num_experts
    if per_expert <= 16:
        return _Tiles(16, 64, 64, 4)
    if per_expert <= 48:
        return _Tiles(32, 64, 64, 4)
    return _Tiles(64, 128, 64, 8)


def _launch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, weights: torch.Tensor,
            align: MoEAlignment, n: int, a_row_div: int, tiles: _Tiles, gated: bool,
            mul_routed_weight: bool) -> None:
    k = a.shape[1]
    blocks = align.block_expert.numel()
    grid = (blocks * triton.cdiv(n, tiles.block_n),)
    _moe_gemm_kernel[grid](
        a, b, c, weights, align.sorted_ids, align.block_expert, align.num_padded,
        n, k, c.shape[0], a_row_div,
        a.stride(0), b.stride(0), b.stride(1), b.stride(2), c.stride(0),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        GATED=gated, MUL_ROUTED_WEIGHT=mul_routed_weight, IEEE=a.dtype == torch.float32,
        num_warps=tiles.num_warps,
    )


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_j topk_weights[t, j] * W2[e] (silu(G[e] x) * U[e] x)`` with ``e =
    topk_ids[t, j]``, ``x = hidden[t]``, ``w13[e] = [G[e]; U[e]]``: two grouped GEMM launches
    over the expert-sorted pairs. ``hidden [T, H]``, ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` share
    a dtype; the result has it. No host synchronization."""
    tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    if w13.shape != (num_experts, 2 * inter, hidden_size) or w2.shape != (
            num_experts, hidden_size, inter):
        raise ValueError(f"expert weights w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do "
                         f"not match hidden size {hidden_size} ([E, 2I, H] and [E, H, I])")
    if not hidden.dtype == w13.dtype == w2.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and expert weights ({w13.dtype}, "
                         f"{w2.dtype}) must share a dtype; cast the activations to the "
                         "weights' dtype")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != tokens:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [{tokens}, top_k]")
    top_k = topk_ids.shape[1]
    pairs = tokens * top_k
    hidden = hidden.contiguous()
    tiles = _tiles(pairs, num_experts)
    align = moe_align(topk_ids, num_experts, tiles.block_m)
    act = torch.empty(pairs, inter, dtype=hidden.dtype, device=hidden.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    _launch(hidden, w13, act, weights, align, inter, top_k, tiles, gated=True,
            mul_routed_weight=False)
    per_pair = torch.empty(pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    _launch(act, w2, per_pair, weights, align, hidden_size, 1, tiles, gated=False,
            mul_routed_weight=True)
    return per_pair.view(tokens, top_k, hidden_size).sum(1, dtype=torch.float32).to(hidden.dtype)


class TritonMoEMethod(UnquantizedMoEMethod):
    """``UnquantizedMoEMethod``'s weights, computed by ``fused_moe``: one code path for
    prefill, decode and CUDA graph capture (nothing is read back to the host)."""

    dense_under_capture = False

    def apply(
        self, layer: nn.Module, hidden: torch.Tensor, topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        return fused_moe(hidden, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)
