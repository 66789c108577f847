"""Triton kernels: the KV-cache write and one paged attention kernel family.

Layout of one layer's cache: ``(2, num_blocks, block_size, num_kv_heads, head_size)``; a
token's slot ``s`` lives at ``[:, s // block_size, s % block_size]``.

``paged_attention`` serves prefill, chunked prefill over a cached prefix, and decode in one
mixed batch. A program owns one *tile* (``BLOCK_Q`` consecutive query tokens of one request)
and one KV head; its ``BLOCK_M`` rows are those queries times the ``GROUP`` query heads that
share the KV head, so each K/V tile is read once for the whole group. It walks the request's
context in ``BLOCK_N``-token tiles (gathering pages through the block table), with an online
softmax in float32 (base-2 exponentials). Tiles entirely below the tile's first query are
visible to every row and skip the causal mask.

An fp8 cache (``FP8``) is read as fp8, half the bytes of bf16, and converted in registers
(exact: every fp8 value is an fp16 value). With bf16 queries the tiles are multiplied in fp16,
not bf16: the GPU converts two fp8 values to fp16 in one instruction, while bf16 takes a detour
through float32 that costs about as much time as reading the fp8 cache (measured on an H100,
TUNING.md entry 8). The bf16 queries are cast to fp16 once per program, clamped to fp16's range
(exact for magnitudes in fp16's normal range; fp16 keeps 3 more mantissa bits than bf16, so the
probabilities ``p`` lose less in the cast, too). The layer's scales never touch the tiles:
``k_scale`` multiplies the softmax scale and ``v_scale`` the output, which is exact since
scores and output are linear in K and V.

How V reaches the tensor cores (``V_WORD``): V is laid out d-contiguous, and the GPU's
transposing shared-memory loads only handle 16-bit elements, so an fp8 V tile read as bytes
(``V_WORD`` 1) is loaded one byte per instruction (TUNING.md entry 8). With ``V_WORD`` 2 or 4
V is read as 16- or 32-bit words of that many fp8 values along d, byte ``j`` of every word is
unpacked to fp16, and the product with V splits into ``V_WORD`` dots, one per residue ``j`` of
d mod ``V_WORD``: accumulator ``j`` holds output columns ``V_WORD * w + j``, written back to
their places at the end. The caller passes V's cache viewed as int16 / int32 words. On CUDA
(``ASM_CVT``) the unpacking is one ``cvt.rn.f16x2.e4m3x2`` (or e5m2) per 16 bits in inline
PTX; elsewhere (the interpreter) Triton's casts compute the same values.

With ``NUM_SPLITS > 1`` (decode batches too small to fill the GPU, "flash decoding"), program
axis 2 splits the context into ranges; each writes its normalized partial output and its
log-sum-exp, and ``merge_splits`` combines them: ``o = sum_i exp(lse_i - lse) o_i`` with
``lse = log sum_i exp(lse_i)``, which does not depend on the order of the splits.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hitchllm.attention.dependent_launch import await_inputs
from hitchllm_attention_triton import fp8_words

_LOG2E = 1.4426950408889634


@triton.jit
def _fp8_grid(x, FP8_MAX: tl.constexpr, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """``x`` (float32) clamped to +-``FP8_MAX`` and rounded to nearest, ties to even, on the
    grid of an fp8 format with ``MANT_BITS`` mantissa bits whose smallest normal exponent is
    ``MIN_EXP``. The result is exactly representable, so the cast to fp8 that follows is
    exact: the cache holds what ``torch``'s cast stores, on any GPU and in Triton's
    interpreter (whose own float-to-fp8 rounding mis-carries into the exponent)."""
    a = tl.minimum(tl.abs(x), FP8_MAX)
    exp = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) - 127, MIN_EXP)
    # The grid's spacing at this exponent and its inverse, both powers of two built from their
    # bits: multiplying by them is exact (no division, which Triton may approximate).
    ulp = ((exp - MANT_BITS + 127) << 23).to(tl.float32, bitcast=True)
    per_ulp = ((MANT_BITS - exp + 127) << 23).to(tl.float32, bitcast=True)
    # Adding and subtracting 1.5 * 2**23 rounds 0 <= t < 2**22 to the nearest even integer.
    t = (a * per_ulp + 12582912.0) - 12582912.0
    negative = x.to(tl.int32, bitcast=True) < 0  # the sign bit: -0.0 stays -0.0, as in a cast
    return tl.where(negative, t * ulp * -1.0, t * ulp)  # Triton's unary minus is 0 - x


@triton.jit
def write_kv_cache(
    key_ptr, value_ptr, cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_key_t, stride_value_t, cache_kv_stride,
    TOKEN_SIZE: tl.constexpr, TOKEN_PAD: tl.constexpr,
    FP8_MAX: tl.constexpr = 0.0, MANT_BITS: tl.constexpr = 0, MIN_EXP: tl.constexpr = 0,
    PDL: tl.constexpr = False,
):
    """One program per token: copy its [num_kv_heads * head_size] K and V to its slot.

    An fp8 cache (``FP8_MAX`` > 0: the format's largest finite value) stores
    ``clamp(K / k_scale)`` rounded to the format (and V likewise), as
    ``hitchllm.attention.quantize_kv`` does; the scale pointers are unused otherwise.
    ``PDL``: launched with ``launch_pdl`` (``hitchllm.attention.dependent_launch``)."""
    await_inputs(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        offs = tl.arange(0, TOKEN_PAD)
        mask = offs < TOKEN_SIZE
        k = tl.load(key_ptr + t * stride_key_t + offs, mask=mask)
        v = tl.load(value_ptr + t * stride_value_t + offs, mask=mask)
        if FP8_MAX > 0:
            k = _fp8_grid(tl.div_rn(k.to(tl.float32), tl.load(k_scale_ptr)), FP8_MAX,
                          MANT_BITS, MIN_EXP)
            v = _fp8_grid(tl.div_rn(v.to(tl.float32), tl.load(v_scale_ptr)), FP8_MAX,
                          MANT_BITS, MIN_EXP)
        dst = cache_ptr + slot.to(tl.int64) * TOKEN_SIZE + offs
        tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + cache_kv_stride, v.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc0, acc1, acc2, acc3, k_cache_ptr, v_cache_ptr, block_table_row,
    kv_head_off, start, kv_end, q_pos, d, d_mask, qk_scale, soft_cap,
    stride_blk, stride_tok,
    MASKED: tl.constexpr, USE_SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, PAD_D: tl.constexpr, FP8: tl.constexpr,
    V_WORD: tl.constexpr, ASM_CVT: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
):
    """One ``BLOCK_N``-token tile of the online softmax. ``acc0`` is the output accumulator;
    with V read as words (``V_WORD`` 2 or 4), ``acc0``.. ``acc3`` are those of the residues
    of d (the ones past ``V_WORD`` are passed through untouched). ``CAUSAL`` False: the caller
    guarantees every position below ``kv_end`` precedes every row's query (one query per tile)."""
    pos = start + tl.arange(0, BLOCK_N)
    in_ctx = pos < kv_end
    if MASKED:
        block = tl.load(block_table_row + pos // PAGE, mask=in_ctx, other=0).to(tl.int64)
    else:  # the caller guarantees the whole tile lies inside the context: no predicates
        block = tl.load(block_table_row + pos // PAGE).to(tl.int64)
    off = block * stride_blk + (pos % PAGE) * stride_tok + kv_head_off
    kv_ptrs = off[:, None] + d[None, :]
    if MASKED:  # noqa: SIM108 (Triton compiles if-blocks on constexprs, not conditional exprs)
        kv_mask = in_ctx[:, None] & d_mask[None, :]
    else:
        kv_mask = d_mask[None, :] & (pos >= 0)[:, None]
    if MASKED or PAD_D:
        k = tl.load(k_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_cache_ptr + kv_ptrs)
    if FP8:  # stored K / k_scale (k_scale is folded into qk_scale by the caller), in q's dtype
        k = k.to(q.dtype)
    s = tl.dot(q, tl.trans(k))
    if USE_SOFTCAP:
        # soft_cap * tanh(s * scale / soft_cap), with tanh(x) = 2 sigmoid(2x) - 1
        s = soft_cap * (2.0 * tl.sigmoid(2.0 * s * (qk_scale / _LOG2E) / soft_cap) - 1.0)
        s = s * _LOG2E
    else:
        s = s * qk_scale
    if MASKED:
        allowed = in_ctx[None, :]
        if CAUSAL:
            allowed = allowed & (pos[None, :] <= q_pos[:, None])
        if WINDOW > 0:
            allowed = allowed & (q_pos[:, None] - pos[None, :] < WINDOW)
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Rows that have seen nothing yet keep m = -inf; subtract 0 instead to avoid inf - inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if V_WORD == 1:
        if MASKED or PAD_D:
            v = tl.load(v_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
        else:
            v = tl.load(v_cache_ptr + kv_ptrs)
        if FP8:  # stored V / v_scale (the caller multiplies the output by v_scale), in q's dtype
            v = v.to(q.dtype)
        acc0 = acc0 * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    else:
        acc0, acc1, acc2, acc3 = _attend_v_words(
            p, alpha, acc0, acc1, acc2, acc3, v_cache_ptr, off, in_ctx, q.dtype,
            k_cache_ptr.dtype.element_ty, MASKED or PAD_D, d.shape[0], V_WORD, ASM_CVT, HEAD_DIM)
    return m_new, l_i, acc0, acc1, acc2, acc3


@triton.jit
def _attend_v_words(
    p, alpha, acc0, acc1, acc2, acc3, v_words_ptr, off, in_ctx, dot_dtype: tl.constexpr,
    fp8_type: tl.constexpr, MASKED: tl.constexpr, HEAD_PAD: tl.constexpr, V_WORD: tl.constexpr,
    ASM_CVT: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """``acc_j = acc_j * alpha + p @ V[:, V_WORD * w + j]`` for each residue ``j``, V read as
    ``V_WORD``-byte words (``off``: each token's offset in elements, a multiple of ``V_WORD``,
    as is ``HEAD_DIM``)."""
    dw = tl.arange(0, HEAD_PAD // V_WORD)
    # off >= 0: a shift divides it (log2 of V_WORD 2 or 4 is V_WORD // 2) without the fixup a
    # signed division needs, and the address stays an add to K's
    w_ptrs = v_words_ptr + (off >> (V_WORD // 2))[:, None] + dw[None, :]
    if MASKED:
        # (dw < HEAD_DIM // V_WORD, not dw * V_WORD < HEAD_DIM: the compiler sees the former
        # constant along runs of words and vectorizes the load)
        w = tl.load(w_ptrs, mask=in_ctx[:, None] & (dw < HEAD_DIM // V_WORD)[None, :], other=0)
    else:
        w = tl.load(w_ptrs)
    if ASM_CVT:
        if V_WORD == 2:
            v0, v1 = fp8_words.pairs_to_fp16(w, fp8_type == tl.float8e5)
        else:
            v0, v1, v2, v3 = fp8_words.quads_to_fp16(w, fp8_type == tl.float8e5)
    else:
        w = w.to(tl.int32)  # 16-bit words sign-extend; the byte masks drop the sign bits
        v0 = fp8_words.byte_to_fp16(w, 0, fp8_type)
        v1 = fp8_words.byte_to_fp16(w, 1, fp8_type)
        if V_WORD == 4:
            v2 = fp8_words.byte_to_fp16(w, 2, fp8_type)
            v3 = fp8_words.byte_to_fp16(w, 3, fp8_type)
    p = p.to(dot_dtype)
    acc0 = acc0 * alpha[:, None] + tl.dot(p, v0.to(dot_dtype))
    acc1 = acc1 * alpha[:, None] + tl.dot(p, v1.to(dot_dtype))
    if V_WORD == 4:
        acc2 = acc2 * alpha[:, None] + tl.dot(p, v2.to(dot_dtype))
        acc3 = acc3 * alpha[:, None] + tl.dot(p, v3.to(dot_dtype))
    return acc0, acc1, acc2, acc3


# The token count only bounds masks and offsets: specializing it (Triton marks an int equal
# to 1 or divisible by 16) would compile a variant of its own for some steps' sizes, on the
# first such step of a process.
@triton.jit(do_not_specialize=["num_tokens"])
def paged_attention(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    block_table_ptr, seq_lens_ptr, query_start_ptr, tile_req_ptr, tile_q0_ptr,
    partial_out_ptr, partial_lse_ptr, k_scale_ptr, v_scale_ptr,
    qk_scale, soft_cap,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_blk, stride_tok, stride_head, stride_bt,
    num_tokens, num_heads,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DECODE: tl.constexpr, FP8: tl.constexpr,
    V_WORD: tl.constexpr = 1, ASM_CVT: tl.constexpr = False, LONGEST_FIRST: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    await_inputs(PDL)
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE and LONGEST_FIRST:
        # Axis 0 runs over (request, KV head) pairs, requests in the order of
        # ``tile_req_ptr`` (longest context first) and each request's heads together.
        kv_heads = num_heads // GROUP
        req = tl.load(tile_req_ptr + tile // kv_heads).to(tl.int32)
        kv_head = tile % kv_heads
        q0 = 0
    elif DECODE:  # one query token per request: tile i is request i
        req = tile
        q0 = 0
    else:
        req = tl.load(tile_req_ptr + tile)
        q0 = tl.load(tile_q0_ptr + tile)
    # The fp8 words path leaves out what decode tiles do not need: the query offsets (request
    # i's one token is token i, which the builder checks) and, below, the causal mask (one
    # query per tile: kv_end applies it). Registers decide how many programs share an SM, and
    # these cost it up to 79 (TUNING.md entry 10). bf16 and the byte path keep the code their
    # tuned timings were measured with.
    LEAN: tl.constexpr = DECODE and V_WORD > 1
    if LEAN:
        q_start = req
        q_len = 1
    else:
        q_start = tl.load(query_start_ptr + req)
        q_len = tl.load(query_start_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = q0 + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = ctx_len + q_idx
    d = tl.arange(0, HEAD_PAD)
    d_mask = d < HEAD_DIM
    token = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_q_t + head[:, None] * stride_q_h + d[None, :],
                mask=row_valid[:, None] & d_mask[None, :], other=0.0)

    if FP8:  # scores are q . (stored K) * k_scale
        qk_scale = qk_scale * tl.load(k_scale_ptr)
        if q.dtype == tl.bfloat16:  # fp8 -> fp16 is one instruction per two values
            q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    # One accumulator per residue of d mod V_WORD (V_WORD 1: acc0 alone, all of d); those
    # past V_WORD pass through the tiles unused.
    acc0 = tl.zeros([BLOCK_M, HEAD_PAD // V_WORD], tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0

    # Context this tile may see: up to its last query's position; from the window's start.
    kv_end = tl.minimum(seq_len, ctx_len + q0 + BLOCK_Q)
    kv_start = 0
    if WINDOW > 0:
        kv_start = tl.maximum(0, ctx_len + q0 - WINDOW + 1) // BLOCK_N * BLOCK_N
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(tl.cdiv(kv_end - kv_start, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_start = kv_start + split * per_split
        kv_end = tl.minimum(kv_end, kv_start + per_split)
    # Positions below the first query's are visible to every row: no mask needed there.
    unmasked_end = kv_start
    if WINDOW == 0:
        unmasked_end = tl.maximum(kv_start, tl.minimum(kv_end, ctx_len + q0) // BLOCK_N * BLOCK_N)

    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    kv_head_off = kv_head * stride_head
    for start in range(kv_start, unmasked_end, BLOCK_N):
        m_i, l_i, acc0, acc1, acc2, acc3 = _attend_tile(
            q, m_i, l_i, acc0, acc1, acc2, acc3, k_cache_ptr, v_cache_ptr, bt_row, kv_head_off,
            start, kv_end, q_pos, d, d_mask, qk_scale, soft_cap, stride_blk, stride_tok,
            False, USE_SOFTCAP, WINDOW, BLOCK_N, PAGE, HEAD_PAD != HEAD_DIM, FP8, V_WORD,
            ASM_CVT, HEAD_DIM, not LEAN)
    for start in range(unmasked_end, kv_end, BLOCK_N):
        m_i, l_i, acc0, acc1, acc2, acc3 = _attend_tile(
            q, m_i, l_i, acc0, acc1, acc2, acc3, k_cache_ptr, v_cache_ptr, bt_row, kv_head_off,
            start, kv_end, q_pos, d, d_mask, qk_scale, soft_cap, stride_blk, stride_tok,
            True, USE_SOFTCAP, WINDOW, BLOCK_N, PAGE, HEAD_PAD != HEAD_DIM, FP8, V_WORD,
            ASM_CVT, HEAD_DIM, not LEAN)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    if V_WORD == 1:
        out = acc0 / l_safe[:, None]
        if FP8:  # the weighted sum of stored V, times v_scale (splits merge linearly)
            out = out * tl.load(v_scale_ptr)
        _store_output(out_ptr, partial_out_ptr, partial_lse_ptr, out, d, d_mask, m_i, l_i,
                      l_safe, token, head, row_valid, split, num_tokens, num_heads, stride_o_t,
                      stride_o_h, HEAD_PAD, NUM_SPLITS, True)
    else:  # residue j's accumulator holds the columns V_WORD * w + j
        scale = (tl.load(v_scale_ptr) / l_safe)[:, None]  # per row, once for all residues
        dw = tl.arange(0, HEAD_PAD // V_WORD)
        cols = dw * V_WORD
        w_mask = dw < HEAD_DIM // V_WORD
        # The log-sum-exp goes out with the last residue: with the first, split decode needs
        # 140 registers instead of 107 (16-bit words, sm_90).
        _store_output(out_ptr, partial_out_ptr, partial_lse_ptr, acc0 * scale, cols, w_mask,
                      m_i, l_i, l_safe, token, head, row_valid, split, num_tokens, num_heads,
                      stride_o_t, stride_o_h, HEAD_PAD, NUM_SPLITS, False)
        _store_output(out_ptr, partial_out_ptr, partial_lse_ptr, acc1 * scale, cols + 1, w_mask,
                      m_i, l_i, l_safe, token, head, row_valid, split, num_tokens, num_heads,
                      stride_o_t, stride_o_h, HEAD_PAD, NUM_SPLITS, V_WORD == 2)
        if V_WORD == 4:
            _store_output(out_ptr, partial_out_ptr, partial_lse_ptr, acc2 * scale, cols + 2,
                          w_mask, m_i, l_i, l_safe, token, head, row_valid, split, num_tokens,
                          num_heads, stride_o_t, stride_o_h, HEAD_PAD, NUM_SPLITS, False)
            _store_output(out_ptr, partial_out_ptr, partial_lse_ptr, acc3 * scale, cols + 3,
                          w_mask, m_i, l_i, l_safe, token, head, row_valid, split, num_tokens,
                          num_heads, stride_o_t, stride_o_h, HEAD_PAD, NUM_SPLITS, True)


@triton.jit
def _store_output(
    out_ptr, partial_out_ptr, partial_lse_ptr, out, cols, col_mask, m_i, l_i, l_safe, token,
    head, row_valid, split, num_tokens, num_heads, stride_o_t, stride_o_h,
    HEAD_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, WITH_LSE: tl.constexpr,
):
    """Columns ``cols`` of the normalized output: into ``out_ptr`` [token, head, d] or, split,
    as partial results [split, token, head, d], with (``WITH_LSE``) the rows' base-2
    log-sum-exp [split, token, head]."""
    out_mask = row_valid[:, None] & col_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + token[:, None] * stride_o_t + head[:, None] * stride_o_h
                 + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        row = (split * num_tokens + token) * num_heads + head
        tl.store(partial_out_ptr + row[:, None] * HEAD_PAD + cols[None, :], out, mask=out_mask)
        if WITH_LSE:
            tl.store(partial_lse_ptr + row, lse, mask=row_valid)


@triton.jit(do_not_specialize=["num_tokens"])
def merge_splits(
    out_ptr, partial_out_ptr, partial_lse_ptr, stride_o_t, stride_o_h, num_tokens, num_heads,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr, PDL: tl.constexpr = False,
):
    """One program per (token, head): combine the splits' partial outputs."""
    await_inputs(PDL)
    token = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    s_mask = s < NUM_SPLITS
    rows = (s * num_tokens + token) * num_heads + head
    lse = tl.load(partial_lse_ptr + rows, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp2(lse - lse_max)
    d = tl.arange(0, HEAD_PAD)
    parts = tl.load(partial_out_ptr + rows[:, None] * HEAD_PAD + d[None, :],
                    mask=s_mask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + token * stride_o_t + head * stride_o_h + d,
             out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)
