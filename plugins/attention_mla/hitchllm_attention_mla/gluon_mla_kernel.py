"""TRITON_MLA's decode kernel for Hopper GPUs (sm_90), written in Gluon (Triton's lower-level
language with explicit layouts); imported only where it runs.

It computes what ``triton_mla_kernel.mla_decode_partials`` computes, with the same arguments
and outputs, for the shapes DeepSeek's MLA has (64 heads per program, a latent of 512 and a
rope part of 64 values, 64-token tiles, 8 warps). Why a second kernel: compiled for an H100,
the Triton kernel's score product runs on both warpgroups at once, each computing the whole
64 x 64 score tile (Triton lays the scores out for the value product, which splits the 512
output columns between the warpgroups and needs every score in both), so the tensor cores do
the score work twice. Here the layouts are chosen by hand:

- scores ``q . latent`` are split by tokens: each warpgroup computes 64 heads x 32 tokens of
  the tile (wgmma from shared memory: the query block and the tile, 64 x 576 each);
- the probabilities go to shared memory once (64 x 64 bf16) and both warpgroups read them as
  the value product's A operand, each for its 256 of the 512 output columns;
- the next tile's copy (cp.async, 16 bytes a thread at a time, positions past the context
  clamped to its last token so no copy is masked) is issued before this tile's products, two
  buffers deep;
- two explicit barriers a tile (the tile has landed; the probabilities are complete), and the
  softmax sums kept per thread until the end (the maxima are the only reduction across
  warpgroups). Compiled (Triton 3.6 and 3.7) the loop has five: the compiler adds one before
  the score product (it cannot tell the two tile buffers apart, so the copy into the other
  one looks like a hazard) and the maxima's reduction takes two.

Shared memory: the query block (72 KiB), two tiles (144 KiB) and the probabilities (8 KiB),
224 KiB of the H100's 227.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

#: The shapes the kernel is written for (``mla_decode`` uses it only for these).
BLOCK_H, BLOCK_N, NUM_WARPS, ROPE = 64, 64, 8, 64

# A barrier of the program's threads: ``gl.barrier`` from Triton 3.7, ``gl.thread_barrier``
# before.
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@gluon.jit
def _copy_tile(cache_ptr, table_row, first, last, c_buf, r_buf,
               KV_LORA_RANK: gl.constexpr, WIDTH: gl.constexpr, PAGE: gl.constexpr,
               BLOCK_N: gl.constexpr, ld_c: gl.constexpr, ld_r: gl.constexpr):
    """Start the copies of the latents at positions ``first .. first + BLOCK_N - 1`` (those
    past ``last`` read position ``last`` again) into ``c_buf`` (the latent part) and
    ``r_buf`` (the rope part)."""
    ROPE_W: gl.constexpr = WIDTH - KV_LORA_RANK
    pos_c = gl.minimum(first + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_c)), last)
    row_c = gl.load(table_row + pos_c // PAGE).to(gl.int64) * PAGE + pos_c % PAGE
    cols_c = gl.arange(0, KV_LORA_RANK, layout=gl.SliceLayout(0, ld_c))
    async_copy.async_copy_global_to_shared(
        c_buf, cache_ptr + row_c[:, None] * WIDTH + cols_c[None, :])
    pos_r = gl.minimum(first + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_r)), last)
    row_r = gl.load(table_row + pos_r // PAGE).to(gl.int64) * PAGE + pos_r % PAGE
    cols_r = gl.arange(0, ROPE_W, layout=gl.SliceLayout(0, ld_r))
    async_copy.async_copy_global_to_shared(
        r_buf, cache_ptr + row_r[:, None] * WIDTH + KV_LORA_RANK + cols_r[None, :])
    async_copy.commit_group()


@gluon.jit
def mla_decode_partials_sm90(
    q_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, acc_ptr, stats_ptr, scale,
    stride_qt, stride_qh, stride_bt, stride_at, stride_ah, stride_as,
    stride_s0, stride_st, stride_sh, num_heads,
    KV_LORA_RANK: gl.constexpr, WIDTH: gl.constexpr, PAGE: gl.constexpr,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
):
    """One program: ``BLOCK_H`` heads (``program_id(0)``) of request ``program_id(2)`` over
    one split (``program_id(1)``) of its context, cut as the Triton kernel cuts it; the whole
    latent output per program. Arguments (shapes, dtypes, units) and outputs as
    ``triton_mla_kernel.mla_decode_partials``'s, which ``mla_decode`` launches the same way."""
    ROPE_W: gl.constexpr = WIDTH - KV_LORA_RANK
    # Scores: warps [4, 2], each warpgroup 64 heads x BLOCK_N / 2 tokens. Output: each
    # warpgroup 64 heads x KV_LORA_RANK / 2 columns.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, KV_LORA_RANK // 2, 16])
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                              rank=2)
    # Copies: 16 bytes a thread, a warp over 2 rows x 128 columns (latent) or 4 x 64 (rope).
    ld_c: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])
    ld_r: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])

    head0 = gl.program_id(0) * BLOCK_H
    split = gl.program_id(1)
    req = gl.program_id(2)
    dtype: gl.constexpr = q_ptr.dtype.element_ty

    # The query block, into shared memory (rows past num_heads are zeros).
    hq_c = head0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld_c))
    cols_c = gl.arange(0, KV_LORA_RANK, layout=gl.SliceLayout(0, ld_c))
    q_rows_c = q_ptr + req * stride_qt + hq_c.to(gl.int64)[:, None] * stride_qh
    q_c = gl.load(q_rows_c + cols_c[None, :],
                  mask=(hq_c < num_heads)[:, None] & (cols_c < KV_LORA_RANK)[None, :],
                  other=0.0)
    hq_r = head0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld_r))
    cols_r = gl.arange(0, ROPE_W, layout=gl.SliceLayout(0, ld_r))
    q_rows_r = q_ptr + req * stride_qt + hq_r.to(gl.int64)[:, None] * stride_qh
    q_r = gl.load(q_rows_r + KV_LORA_RANK + cols_r[None, :],
                  mask=(hq_r < num_heads)[:, None] & (cols_r < ROPE_W)[None, :], other=0.0)
    qc_s = gl.allocate_shared_memory(dtype, [BLOCK_H, KV_LORA_RANK], smem, value=q_c)
    qr_s = gl.allocate_shared_memory(dtype, [BLOCK_H, ROPE_W], smem, value=q_r)
    c_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, KV_LORA_RANK], smem)
    r_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, ROPE_W], smem)
    p_s = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], smem)

    # int32 whatever the lengths' dtype (mixed batches pass int64): the tile index picks a
    # shared-memory buffer, which takes an int32 index.
    seq_len = gl.load(seq_lens_ptr + req).to(gl.int32)
    per_split = gl.cdiv(gl.cdiv(seq_len, gl.num_programs(1)), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = gl.minimum(start + per_split, seq_len)
    num_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
    table_row = block_table_ptr + req * stride_bt

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    # Each thread's share of the softmax sums, rescaled with the maxima and reduced over the
    # warps once, after the loop (a reduction across the warpgroups costs shared memory and a
    # barrier a tile).
    l_part = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
    o = gl.zeros([BLOCK_H, KV_LORA_RANK], gl.float32, layout=o_layout)
    fence_async_shared()
    if num_tiles > 0:
        _copy_tile(cache_ptr, table_row, start, end - 1, c_bufs.index(0), r_bufs.index(0),
                   KV_LORA_RANK, WIDTH, PAGE, BLOCK_N, ld_c, ld_r)
    for t in range(0, num_tiles):
        stage = t % 2
        async_copy.wait_group(0)
        # Every thread's copies of tile t have landed, and every warp is past the previous
        # tile's value product: the other buffer and p_s are free.
        _cta_barrier()
        fence_async_shared()
        if t + 1 < num_tiles:
            _copy_tile(cache_ptr, table_row, start + (t + 1) * BLOCK_N, end - 1,
                       c_bufs.index(1 - stage), r_bufs.index(1 - stage),
                       KV_LORA_RANK, WIDTH, PAGE, BLOCK_N, ld_c, ld_r)
        c_t = c_bufs.index(stage)
        r_t = r_bufs.index(stage)
        s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
        s = warpgroup_mma(qc_s, c_t.permute((1, 0)), s, use_acc=False, is_async=True)
        s = warpgroup_mma(qr_s, r_t.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
        pos = start + t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where((pos < end)[None, :], s * scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        p = gl.exp2(s - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_part = l_part * alpha[:, None] + p
        m_i = m_new
        p_s.store(p.to(dtype))
        o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        fence_async_shared()
        _cta_barrier()  # both warpgroups' probabilities are in p_s
        o = warpgroup_mma(p_s, c_t, o, is_async=True)
        o = warpgroup_mma_wait(num_outstanding=0, deps=[o])
    l_i = gl.sum(l_part, 1)

    heads_o = head0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
    cols_o = gl.arange(0, KV_LORA_RANK, layout=gl.SliceLayout(0, o_layout))
    if gl.num_programs(1) == 1:
        # An empty context (padding row) has l_i == 0 and o == 0: store zeros, not NaN.
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        o = o / gl.maximum(l_o, 1e-30)[:, None]
    out = (acc_ptr + req * stride_at + heads_o.to(gl.int64)[:, None] * stride_ah
           + split * stride_as + cols_o[None, :])
    gl.store(out, o.to(acc_ptr.dtype.element_ty),
             mask=(heads_o < num_heads)[:, None] & (cols_o < KV_LORA_RANK)[None, :])
    heads_s = head0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, s_layout))
    stats = stats_ptr + req * stride_st + heads_s * stride_sh + split
    gl.store(stats, m_i, mask=heads_s < num_heads)
    gl.store(stats + stride_s0, l_i, mask=heads_s < num_heads)
