"""TRITON_MLA's decode kernel for Hopper GPUs (sm_90), written in Gluon (Triton's lower-level
language with explicit layouts and warp specialization); imported only where it runs.

It computes what ``triton_mla_kernel.mla_decode_partials`` computes, with the same arguments
and outputs, for the shapes DeepSeek's MLA has (64 heads per program, a latent of 512 and a
rope part of 64 values). Its programs are cut into splits as the Triton kernel's are
(``BLOCK_N`` tokens) and walk their tokens in 32-token tiles.

Two warpgroups take turns ("seesaw"): warpgroup ``r`` owns the tiles ``t`` with ``t % 2 ==
r``. For its own tile the owner computes the scores ``q . latent`` (64 heads x 32 tokens, the
query block and the tile from shared memory), the online softmax against the running maximum
the other warpgroup handed over for the tile before, and hands the tile's probabilities and
row statistics (maximum, rescale factor, sum) to the other warpgroup through shared memory
and an mbarrier. Both warpgroups multiply every tile's probabilities by their own 256 of the
512 latent output columns, so each keeps half the output (64 x 256 float32) in registers.
While one warpgroup runs its softmax the other's score product runs on the tensor cores.
Against the kernel this replaced (both warpgroups on every tile: scores split by tokens, two
CTA-wide barriers a tile) it reads the query block once per tile instead of twice and has no
CTA-wide barrier in its loop.

Tiles come in with cp.async, four 32-token buffers deep. Each warpgroup copies its own half of
the latent columns of every tile (the half it multiplies, so it can refill that half as soon
as its own product is done) and the rope part of its own tiles (only its score product reads
it); each thread's copies arrive on the tile's mbarrier (256 arrivals a tile). The block-table
rows of a refill are loaded at the top of a step, long before its copies are issued.

Shared memory: the query's latent part (64 KiB; the rope part sits in registers as the score
product's A operand), four tiles (144 KiB), four probability tiles (16 KiB), two slots of row
statistics and the mbarriers: 226 KiB of the H100's 227.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

#: The tiles ``mla_decode`` selects this kernel with (``triton_mla.HOPPER_TILES``): 64 heads
#: per program, splits cut at 64 tokens, 8 warps in all.
BLOCK_H, BLOCK_N, NUM_WARPS, ROPE = 64, 64, 8, 64
#: The warps a launch names: one warpgroup; ``warp_specialize`` adds the second.
LAUNCH_WARPS = 4


#: The layout tiles are loaded through (each thread 8 consecutive values of a row).
LOAD_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))


@gluon.constexpr_function
def mma_layout(columns):
    """One warpgroup's wgmma accumulator layout for 64 rows and ``columns`` columns (the
    scores of a tile, or its half of the output)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, columns, 16])


@gluon.jit
def _rows(table_row, first, last, TILE: gl.constexpr, PAGE: gl.constexpr,
          layout: gl.constexpr):
    """Cache rows of positions ``first .. first + TILE - 1`` (those past ``last`` read
    position ``last``, so no copy is masked)."""
    pos = gl.minimum(first + gl.arange(0, TILE, layout=gl.SliceLayout(1, layout)), last)
    return gl.load(table_row + pos // PAGE).to(gl.int64) * PAGE + pos % PAGE


@gluon.jit
def _copy(cache_ptr, rows, buf, COL0: gl.constexpr, COLS: gl.constexpr, WIDTH: gl.constexpr,
          layout: gl.constexpr):
    """Start copying columns ``COL0 .. COL0 + COLS - 1`` of the cache ``rows`` into ``buf``."""
    cols = COL0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    async_copy.async_copy_global_to_shared(buf, cache_ptr + rows[:, None] * WIDTH + cols[None, :])


@gluon.jit
def _step(u, HAS_OTHER: gl.constexpr, HAS_OWN: gl.constexpr, ROLE: gl.constexpr,
          m_i, l_i, o, q_rope, cache_ptr, table_row, scale, start, end, num_tiles,
          q_smem, tiles, ropes, probs, st_max, st_alpha, st_sum, landed, handed,
          KV_LORA_RANK: gl.constexpr, WIDTH: gl.constexpr, PAGE: gl.constexpr,
          BLOCK_H: gl.constexpr, TILE: gl.constexpr):
    """One turn of warpgroup ``ROLE``: the other warpgroup's tile ``u - 1`` (``HAS_OTHER``)
    and its own tile ``u`` (``HAS_OWN``). Returns the running maximum, sum and output half."""
    ROPE_W: gl.constexpr = WIDTH - KV_LORA_RANK
    HALF: gl.constexpr = KV_LORA_RANK // 2
    s_layout: gl.constexpr = mma_layout(TILE)
    o_layout: gl.constexpr = mma_layout(HALF)
    ld: gl.constexpr = LOAD_LAYOUT
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    v = u - 1
    # The refills' block-table rows, loaded now and used after the products.
    if HAS_OTHER:
        rows_other = _rows(table_row, start + (u + 3) * TILE, end - 1, TILE, PAGE, ld)
    if HAS_OWN:
        rows_own = _rows(table_row, start + (u + 4) * TILE, end - 1, TILE, PAGE, ld)
        mbarrier.wait(landed.index(u % 4), (u // 4) & 1)
        fence_async_shared()  # cp.async wrote the tile; the tensor cores read it
        s = gl.zeros([BLOCK_H, TILE], gl.float32, layout=s_layout)
        # ``u >> 30`` is 0 but not a constant: it keeps ptxas from hoisting the query block's
        # 32 descriptors out of the loop (they spilled).
        s = warpgroup_mma(q_smem.index(u >> 30), tiles.index(u % 4).permute((1, 0)), s,
                          use_acc=False, is_async=True)
        s = warpgroup_mma(q_rope, ropes.index(u % 4).permute((1, 0)), s, is_async=True)
    if HAS_OTHER:
        mbarrier.wait(handed.index(v % 2), (v // 2) & 1)
        alpha_v = st_alpha.index(v % 2).load(row_o)
        m_i = st_max.index(v % 2).load(row_s)
        l_i = l_i * alpha_v + st_sum.index(v % 2).load(row_o)
    if HAS_OWN:
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
        if u + 4 < num_tiles:  # our tile u + 4's rope part: only our score product reads it
            _copy(cache_ptr, rows_own, ropes.index(u % 4), KV_LORA_RANK, ROPE_W, WIDTH, ld)
        pos = start + u * TILE + gl.arange(0, TILE, layout=gl.SliceLayout(0, s_layout))
        s = gl.where((pos < end)[None, :], s * scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        p = gl.exp2(s - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        rs = gl.sum(p, 1)
        probs.index(u % 4).store(p.to(q_smem.dtype))
        st_max.index(u % 2).store(m_new)
        st_alpha.index(u % 2).store(alpha)
        st_sum.index(u % 2).store(rs)
        fence_async_shared()  # the other warpgroup's tensor cores read the probabilities
        mbarrier.arrive(handed.index(u % 2))
        m_i = m_new
    if HAS_OTHER:
        o = o * alpha_v[:, None]
        o = warpgroup_mma(probs.index(v % 4), tiles.index(v % 4).slice(ROLE * HALF, HALF, 1),
                          o, is_async=True)
        o = warpgroup_mma_wait(num_outstanding=0, deps=[o])
        if u + 3 < num_tiles:  # the other's tile u + 3 into our half of tile v's buffer
            _copy(cache_ptr, rows_other, tiles.index(v % 4).slice(ROLE * HALF, HALF, 1),
                  ROLE * HALF, HALF, WIDTH, ld)
            async_copy.mbarrier_arrive(landed.index(v % 4), increment_count=False)
    if HAS_OWN:
        alpha_o = gl.convert_layout(alpha, row_o)
        l_i = l_i * alpha_o + gl.convert_layout(rs, row_o)
        o = o * alpha_o[:, None]
        o = warpgroup_mma(probs.index(u % 4), tiles.index(u % 4).slice(ROLE * HALF, HALF, 1),
                          o, is_async=True)
        o = warpgroup_mma_wait(num_outstanding=0, deps=[o])
        if u + 4 < num_tiles:
            _copy(cache_ptr, rows_own, tiles.index(u % 4).slice(ROLE * HALF, HALF, 1),
                  ROLE * HALF, HALF, WIDTH, ld)
            async_copy.mbarrier_arrive(landed.index(u % 4), increment_count=False)
    return m_i, l_i, o


@gluon.jit
def _warpgroup(ROLE: gl.constexpr, q_ptr, cache_ptr, table_row, acc_ptr, stats_ptr, req, split,
               head0, scale, start, end, num_tiles, stride_qt, stride_qh, stride_at, stride_ah,
               stride_as, stride_s0, stride_st, stride_sh, num_heads,
               q_smem, tiles, ropes, probs, st_max, st_alpha, st_sum, landed, handed,
               KV_LORA_RANK: gl.constexpr, WIDTH: gl.constexpr, PAGE: gl.constexpr,
               BLOCK_H: gl.constexpr, TILE: gl.constexpr):
    """Warpgroup ``ROLE``'s whole program: its copies of the first four tiles, its turns, and
    its half of the output (and, for warpgroup 0, the row statistics)."""
    ROPE_W: gl.constexpr = WIDTH - KV_LORA_RANK
    HALF: gl.constexpr = KV_LORA_RANK // 2
    s_layout: gl.constexpr = mma_layout(TILE)
    o_layout: gl.constexpr = mma_layout(HALF)
    q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    ld: gl.constexpr = LOAD_LAYOUT
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    heads = head0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, q_layout))
    cols = gl.arange(0, ROPE_W, layout=gl.SliceLayout(0, q_layout))
    q_rope = gl.load(q_ptr + req * stride_qt + heads.to(gl.int64)[:, None] * stride_qh
                     + KV_LORA_RANK + cols[None, :],
                     mask=(heads < num_heads)[:, None] & (cols < ROPE_W)[None, :], other=0.0)
    for t in gl.static_range(4):
        if t < num_tiles:
            rows = _rows(table_row, start + t * TILE, end - 1, TILE, PAGE, ld)
            _copy(cache_ptr, rows, tiles.index(t).slice(ROLE * HALF, HALF, 1), ROLE * HALF,
                  HALF, WIDTH, ld)
            if t % 2 == ROLE:
                _copy(cache_ptr, rows, ropes.index(t), KV_LORA_RANK, ROPE_W, WIDTH, ld)
            async_copy.mbarrier_arrive(landed.index(t), increment_count=False)

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=row_o)
    o = gl.zeros([BLOCK_H, HALF], gl.float32, layout=o_layout)
    # Turns: warpgroup 0 starts with tile 0 alone; the last turn may be the other's last tile.
    first = ROLE
    if ROLE == 0:
        if num_tiles > 0:
            m_i, l_i, o = _step(num_tiles >> 30, False, True, ROLE, m_i, l_i, o, q_rope,
                                cache_ptr, table_row, scale, start, end, num_tiles, q_smem,
                                tiles, ropes, probs, st_max, st_alpha, st_sum, landed, handed,
                                KV_LORA_RANK, WIDTH, PAGE, BLOCK_H, TILE)
        first = 2
    for u in range(first, num_tiles, 2):
        m_i, l_i, o = _step(u, True, True, ROLE, m_i, l_i, o, q_rope, cache_ptr, table_row,
                            scale, start, end, num_tiles, q_smem, tiles, ropes, probs, st_max,
                            st_alpha, st_sum, landed, handed, KV_LORA_RANK, WIDTH, PAGE,
                            BLOCK_H, TILE)
    if (num_tiles > 0) & (num_tiles % 2 == ROLE):
        m_i, l_i, o = _step(num_tiles, True, False, ROLE, m_i, l_i, o, q_rope, cache_ptr,
                            table_row, scale, start, end, num_tiles, q_smem, tiles, ropes, probs,
                            st_max, st_alpha, st_sum, landed, handed, KV_LORA_RANK, WIDTH, PAGE,
                            BLOCK_H, TILE)

    heads_o = head0 + gl.arange(0, BLOCK_H, layout=row_o)
    cols_o = ROLE * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_layout))
    if gl.num_programs(1) == 1:
        # An empty context (padding row) has l_i == 0 and o == 0: store zeros, not NaN.
        o = o / gl.maximum(l_i, 1e-30)[:, None]
    out = (acc_ptr + req * stride_at + heads_o.to(gl.int64)[:, None] * stride_ah
           + split * stride_as + cols_o[None, :])
    gl.store(out, o.to(acc_ptr.dtype.element_ty),
             mask=(heads_o < num_heads)[:, None] & (cols_o < KV_LORA_RANK)[None, :])
    if ROLE == 0:
        stats = stats_ptr + req * stride_st + heads_o * stride_sh + split
        gl.store(stats, gl.convert_layout(m_i, row_o), mask=heads_o < num_heads)
        gl.store(stats + stride_s0, l_i, mask=heads_o < num_heads)


#: Arguments Triton must not specialize on: the row statistics' strides follow the number of
#: splits, which follows the batch, so specializing on them (a value of 1, a multiple of 16)
#: would build this kernel (seconds each; 8-9 s on an H100 host) again for new batch shapes in
#: the middle of a run. Its few stores do not need their alignment.
UNSPECIALIZED = ("stride_s0", "stride_st", "stride_sh")


@gluon.jit(do_not_specialize=UNSPECIALIZED)
def mla_decode_partials_sm90(
    q_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, acc_ptr, stats_ptr, scale,
    stride_qt, stride_qh, stride_bt, stride_at, stride_ah, stride_as,
    stride_s0, stride_st, stride_sh, num_heads,
    KV_LORA_RANK: gl.constexpr, WIDTH: gl.constexpr, PAGE: gl.constexpr,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
):
    """One program: ``BLOCK_H`` heads (``program_id(0)``) of request ``program_id(2)`` over
    one split (``program_id(1)``) of its context, cut as the Triton kernel cuts it; the whole
    latent output per program. Launched with ``LAUNCH_WARPS`` warps. Arguments (shapes, dtypes,
    units) and outputs as ``triton_mla_kernel.mla_decode_partials``'s, which ``mla_decode``
    launches the same way."""
    ROPE_W: gl.constexpr = WIDTH - KV_LORA_RANK
    TILE: gl.constexpr = BLOCK_N // 2
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                              rank=2)
    p_smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * TILE,
                                                element_bitwidth=16, rank=2)
    vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    ld_q: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    head0 = gl.program_id(0) * BLOCK_H
    split = gl.program_id(1)
    req = gl.program_id(2)
    dtype: gl.constexpr = q_ptr.dtype.element_ty

    # The query's latent part, into shared memory (rows past num_heads are zeros).
    hq = head0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld_q))
    cq = gl.arange(0, KV_LORA_RANK, layout=gl.SliceLayout(0, ld_q))
    q_c = gl.load(q_ptr + req * stride_qt + hq.to(gl.int64)[:, None] * stride_qh + cq[None, :],
                  mask=(hq < num_heads)[:, None] & (cq < KV_LORA_RANK)[None, :], other=0.0)
    q_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_H, KV_LORA_RANK], smem)
    q_smem.index(0).store(q_c)
    tiles = gl.allocate_shared_memory(dtype, [4, TILE, KV_LORA_RANK], smem)
    ropes = gl.allocate_shared_memory(dtype, [4, TILE, ROPE_W], smem)
    probs = gl.allocate_shared_memory(dtype, [4, BLOCK_H, TILE], p_smem)
    st_max = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], vec)
    st_alpha = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], vec)
    st_sum = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], vec)
    # landed[b]: tile buffer b is full (every thread's copies); handed[s]: a tile's
    # probabilities and row statistics are in slot s (one arrival, after the partition's
    # stores).
    landed = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    handed = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(4):
        mbarrier.init(landed.index(i), count=8 * 32)
    for i in gl.static_range(2):
        mbarrier.init(handed.index(i), count=1)
    fence_async_shared()

    # int32 whatever the lengths' dtype (the engine passes int32, mla_decode takes int64).
    seq_len = gl.load(seq_lens_ptr + req).to(gl.int32)
    per_split = gl.cdiv(gl.cdiv(seq_len, gl.num_programs(1)), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = gl.minimum(start + per_split, seq_len)
    num_tiles = gl.cdiv(gl.maximum(end - start, 0), TILE)
    table_row = block_table_ptr + req * stride_bt
    # Registers: each warpgroup keeps 64 x 256 float32 of output; setmaxnreg gives both the
    # whole register file (256 a thread).
    gl.warp_specialize([
        (_warpgroup, (0, q_ptr, cache_ptr, table_row, acc_ptr, stats_ptr, req, split, head0,
                      scale, start, end, num_tiles, stride_qt, stride_qh, stride_at, stride_ah,
                      stride_as, stride_s0, stride_st, stride_sh, num_heads, q_smem, tiles,
                      ropes, probs, st_max, st_alpha, st_sum, landed, handed, KV_LORA_RANK,
                      WIDTH, PAGE, BLOCK_H, TILE)),
        (_warpgroup, (1, q_ptr, cache_ptr, table_row, acc_ptr, stats_ptr, req, split, head0,
                      scale, start, end, num_tiles, stride_qt, stride_qh, stride_at, stride_ah,
                      stride_as, stride_s0, stride_st, stride_sh, num_heads, q_smem, tiles,
                      ropes, probs, st_max, st_alpha, st_sum, landed, handed, KV_LORA_RANK,
                      WIDTH, PAGE, BLOCK_H, TILE))], [4], [256])
