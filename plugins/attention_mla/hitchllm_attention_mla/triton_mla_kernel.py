"""The Triton kernel of TRITON_MLA's decode (imported only when it runs: needs triton)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile_mask(rows_ok, cols, LIMIT: tl.constexpr, BLOCK: tl.constexpr):
    """The mask of a [rows, ``BLOCK``] tile whose columns ``cols`` (one block of them) must
    stay below ``LIMIT``: ``rows_ok`` alone ([rows, 1], broadcast by the load) where the block
    fits the dims, so no column is compared at run time."""
    if BLOCK == LIMIT:
        return rows_ok[:, None]
    else:
        return rows_ok[:, None] & (cols < LIMIT)[None, :]


@triton.jit
def mla_decode_partials(
    q_ptr,  # [N, H, W]: absorbed no-rope part (L values), then the rope part (W - L)
    cache_ptr,  # [blocks, block_size, W], contiguous
    block_table_ptr,  # [N, cols] int32
    seq_lens_ptr,  # [N]
    acc_ptr,  # [N, H, S, L]: each split's latent output (normalized when S == 1)
    stats_ptr,  # [2, N, H, S] float32: each split's running maximum (log2 units), its sum
    scale,  # the softmax scale times log2(e): the kernel exponentiates with exp2
    stride_qt, stride_qh, stride_bt, stride_at, stride_ah, stride_as,
    stride_s0, stride_st, stride_sh,
    num_heads,
    KV_LORA_RANK: tl.constexpr, WIDTH: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_O: tl.constexpr,
):
    """One program: ``BLOCK_H`` heads and ``BLOCK_O`` of the latent output's columns of
    request ``program_id(2)``, over one split (``program_id(1)``) of its context. Every latent
    row it reads serves all its heads (the MLA cache has one vector per token); the programs
    of the other head blocks and column chunks of the same split come next in launch order
    (``program_id(0)``), so they find those rows in L2 rather than in memory.

    Each context is cut into ``num_programs(1)`` equal splits (whole ``BLOCK_N`` tiles) from
    its length read on the device, so the launch depends on no host value but the split count;
    a split past the context (or a padding request's empty context) stores a running maximum
    of -inf and a sum of 0. With one split the program stores the normalized output itself
    (no merge follows).

    The latent width, its split and the page size are compile-time constants (one compile per
    model and page size): with them as arguments, the per-element masks and the division of
    each position by the page size made the loop issue-bound on integer work (on an H100 the
    tile loads alone took as long as the whole kernel)."""
    CHUNKS: tl.constexpr = BLOCK_L // BLOCK_O
    ROPE: tl.constexpr = WIDTH - KV_LORA_RANK
    heads = (tl.program_id(0) // CHUNKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    chunk = tl.program_id(0) % CHUNKS
    split = tl.program_id(1)
    req = tl.program_id(2)
    head_ok = heads < num_heads
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    offs_o = chunk * BLOCK_O + tl.arange(0, BLOCK_O)

    q_rows = q_ptr + req * stride_qt + heads[:, None] * stride_qh
    q_c = tl.load(q_rows + offs_l[None, :],
                  mask=_tile_mask(head_ok, offs_l, KV_LORA_RANK, BLOCK_L), other=0.0)
    q_r = tl.load(q_rows + KV_LORA_RANK + offs_r[None, :],
                  mask=_tile_mask(head_ok, offs_r, ROPE, BLOCK_R), other=0.0)

    seq_len = tl.load(seq_lens_ptr + req)
    per_split = tl.cdiv(tl.cdiv(seq_len, tl.num_programs(1)), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_O], dtype=tl.float32)
    for first in range(start, end, BLOCK_N):
        pos = first + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        block = tl.load(block_table_ptr + req * stride_bt + pos // PAGE, mask=pos_ok,
                        other=0).to(tl.int64)
        rows = cache_ptr + (block * PAGE + pos % PAGE)[:, None] * WIDTH
        c = tl.load(rows + offs_l[None, :],
                    mask=_tile_mask(pos_ok, offs_l, KV_LORA_RANK, BLOCK_L), other=0.0)
        r = tl.load(rows + KV_LORA_RANK + offs_r[None, :],
                    mask=_tile_mask(pos_ok, offs_r, ROPE, BLOCK_R), other=0.0)
        scores = tl.dot(q_c, tl.trans(c)) + tl.dot(q_r, tl.trans(r))
        scores = tl.where(pos_ok[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if CHUNKS == 1:
            v = c
        else:
            v = tl.load(rows + offs_o[None, :],
                        mask=_tile_mask(pos_ok, offs_o, KV_LORA_RANK, BLOCK_L), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out = acc_ptr + req * stride_at + heads[:, None] * stride_ah + split * stride_as
    if tl.num_programs(1) == 1:
        # An empty context (padding row) has l_i == 0 and acc == 0: store zeros, not NaN.
        acc = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(out + offs_o[None, :], acc.to(acc_ptr.dtype.element_ty),
             mask=_tile_mask(head_ok, offs_o, KV_LORA_RANK, BLOCK_L))
    if chunk == 0:
        stats = stats_ptr + req * stride_st + heads * stride_sh + split
        tl.store(stats, m_i, mask=head_ok)
        tl.store(stats + stride_s0, l_i, mask=head_ok)


@triton.jit
def mla_merge_splits(
    acc_ptr,  # [N, H, S, L] float32: each split's unnormalized latent output
    stats_ptr,  # [2, N, H, S] float32: each split's running maximum (log2 units), its sum
    out_ptr,  # [N, H, L]: the merged, normalized output
    stride_at, stride_ah, stride_as, stride_s0, stride_st, stride_sh, stride_ot, stride_oh,
    num_splits, kv_lora_rank,
    BLOCK_S: tl.constexpr, BLOCK_O: tl.constexpr,
):
    """One program: ``BLOCK_O`` latent columns (``program_id(2)``) of head ``program_id(1)``
    of request ``program_id(0)``. Each split's partial weighs ``exp2(max_s - max)`` (an empty
    split, maximum -inf, weighs 0) and the sum is divided by the weighed total; an empty
    context (every split empty) gives zeros, not NaN."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    stats = stats_ptr + req * stride_st + head * stride_sh
    m = tl.load(stats + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    sums = tl.load(stats + stride_s0 + offs_s, mask=offs_s < num_splits, other=0.0)
    top = tl.maximum(tl.max(m, 0), -3.0e38)  # finite: an empty context's weights are 0
    norm = 1.0 / tl.maximum(tl.sum(tl.exp2(m - top) * sums, 0), 1e-30)
    offs_o = tl.program_id(2) * BLOCK_O + tl.arange(0, BLOCK_O)
    o_ok = offs_o < kv_lora_rank
    partials = acc_ptr + req * stride_at + head * stride_ah + offs_o
    out = tl.zeros([BLOCK_O], dtype=tl.float32)
    for split in range(0, num_splits):
        weight = tl.exp2(tl.load(stats + split) - top)
        out += weight * tl.load(partials + split * stride_as, mask=o_ok, other=0.0)
    tl.store(out_ptr + req * stride_ot + head * stride_oh + offs_o,
             (out * norm).to(out_ptr.dtype.element_ty), mask=o_ok)
