"""fp8 KV decode in TRITON_ATTN: variants that read V as words instead of bytes (issue 15).

TUNING.md entry 8 traced the fp8 decode gap (0.65x of bf16, goal <= 0.6x) to the V tile: fp8,
d-contiguous in shared memory, it reaches the tensor cores one ``ld.shared.b8`` per value. The
variants here load V as ``V_WORD``-byte words (4 or 2 fp8 values along d), unpack byte ``j`` of
every word to fp16 and split the PV product into ``V_WORD`` dots over d's residues mod
``V_WORD`` (accumulator ``j`` holds output columns ``V_WORD * w + j``), so every shared load of
V is 16 or 32 bits wide. Unpacking, per variant:

- ``cvt``: Triton's casts (byte -> uint8 -> fp8 bitcast -> fp16), which the compiler lowers to
  ``cvt.rn.f16x2.e4m3x2`` (or the e5m2 form);
- ``int``: integer ops only, no conversion instruction: e5m2 bits shifted left by 8 are the
  fp16 bits; e4m3's sign and 7 low bits placed as fp16 bits give the value times 2^-8 (exact,
  subnormals included), and the 2^8 goes into ``v_scale``;
- ``asm``: inline PTX, ``cvt.rn.f16x2.e4m3x2`` on each 16-bit half of the word (GPU only).

Rows: bf16 and fp8 through the installed plugin's ``paged_attention`` (the baseline), the
plugin's own words path at its fp8 tile when the installed plugin has one (branch wip-fp8:
``plugin w2-asm`` is its default), the same byte-wise fp8 path re-implemented here (``bytes``:
checks this file's kernel against the plugin's), then each variant over a few (BLOCK_N,
warps, stages). The headline shape
(64 x 2048, GQA 32/8) gets every configuration; the other four shapes of
``benchmarks/attention.py --kv-cache-dtype fp8`` get each variant's best configuration from
the headline. Times are device times of CUDA-graph replays of the attention kernel plus the
split merge (the K/V write launch that ``benchmarks/attention.py`` also times is left out for
every row alike). Each output is checked against a float64 attention over the same fp8 cache
(max abs error; ``WRONG`` above 2e-2).

    python gpu_try/fp8_decode_sweep.py [--e5m2] [--budget-s 150]
    python gpu_try/fp8_decode_sweep.py --cpu   # interpreter, tiny shapes, errors only
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

if "--cpu" in sys.argv:  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton
import triton.language as tl

from hitchllm_attention_triton import kernels as plugin_kernels
from hitchllm_attention_triton.config import choose_kernel_config

LOG2E = 1.4426950408889634
HEAD = 128
PAGE = 16
K_SCALE, V_SCALE = 0.75, 1.5  # exact in bf16 times any fp8 value

UNPACK = {"cvt": 0, "int": 1, "asm": 2}


# ---- the variant kernel (decode only: one query token per request) -------------------------


@triton.jit
def _residue_fp16(w, J: tl.constexpr, E5M2: tl.constexpr, UNPACK: tl.constexpr):
    """Byte ``J`` of every int32 word of ``w`` as fp16 (for e4m3 with ``UNPACK`` 1: times
    2^-8)."""
    b = (w >> (8 * J)) & 0xFF
    if UNPACK == 0:
        if E5M2:
            v = b.to(tl.uint8).to(tl.float8e5, bitcast=True).to(tl.float16)
        else:
            v = b.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    else:
        if E5M2:  # noqa: SIM108
            h = b << 8
        else:
            h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
        v = h.to(tl.int16).to(tl.float16, bitcast=True)
    return v


@triton.jit
def _asm_pair(w16, E5M2: tl.constexpr):
    """The two fp8 values of each 16-bit word as fp16 (one cvt per word)."""
    if E5M2:  # (the asm strings are literals: Triton has no str variables)
        v0, v1 = tl.inline_asm_elementwise(
            "{ .reg .b32 a; cvt.rn.f16x2.e5m2x2 a, $2; mov.b32 {$0, $1}, a; }", "=h,=h,h",
            [w16], dtype=(tl.int16, tl.int16), is_pure=True, pack=1)
    else:
        v0, v1 = tl.inline_asm_elementwise(
            "{ .reg .b32 a; cvt.rn.f16x2.e4m3x2 a, $2; mov.b32 {$0, $1}, a; }", "=h,=h,h",
            [w16], dtype=(tl.int16, tl.int16), is_pure=True, pack=1)
    return v0.to(tl.float16, bitcast=True), v1.to(tl.float16, bitcast=True)


@triton.jit
def _asm_quad(w, E5M2: tl.constexpr):
    """The four fp8 values of each 32-bit word as fp16 (two cvts per word)."""
    if E5M2:
        v0, v1, v2, v3 = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; .reg .b32 a, b; mov.b32 {lo, hi}, $4; "
            "cvt.rn.f16x2.e5m2x2 a, lo; cvt.rn.f16x2.e5m2x2 b, hi; "
            "mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }", "=h,=h,=h,=h,r", [w],
            dtype=(tl.int16, tl.int16, tl.int16, tl.int16), is_pure=True, pack=1)
    else:
        v0, v1, v2, v3 = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; .reg .b32 a, b; mov.b32 {lo, hi}, $4; "
            "cvt.rn.f16x2.e4m3x2 a, lo; cvt.rn.f16x2.e4m3x2 b, hi; "
            "mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }", "=h,=h,=h,=h,r", [w],
            dtype=(tl.int16, tl.int16, tl.int16, tl.int16), is_pure=True, pack=1)
    return (v0.to(tl.float16, bitcast=True), v1.to(tl.float16, bitcast=True),
            v2.to(tl.float16, bitcast=True), v3.to(tl.float16, bitcast=True))


@triton.jit
def _decode_tile(
    q, m_i, l_i, a0, a1, a2, a3, k_ptr, v_ptr, bt_row, k_head_off, v_head_off, start, kv_end,
    qk_scale, stride_blk, stride_tok, stride_vblk, stride_vtok,
    MASKED: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, HEAD: tl.constexpr,
    V_WORD: tl.constexpr, UNPACK: tl.constexpr, E5M2: tl.constexpr,
):
    pos = start + tl.arange(0, BLOCK_N)
    in_ctx = pos < kv_end
    if MASKED:
        block = tl.load(bt_row + pos // PAGE, mask=in_ctx, other=0).to(tl.int64)
    else:
        block = tl.load(bt_row + pos // PAGE).to(tl.int64)
    slot = pos % PAGE
    d = tl.arange(0, HEAD)
    k_ptrs = k_ptr + (block * stride_blk + slot * stride_tok + k_head_off)[:, None] + d[None, :]
    if MASKED:  # noqa: SIM108
        k = tl.load(k_ptrs, mask=in_ctx[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
    s = tl.dot(q, tl.trans(k.to(q.dtype))) * qk_scale
    if MASKED:
        s = tl.where(in_ctx[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    dw = tl.arange(0, HEAD // V_WORD)
    v_ptrs = v_ptr + (block * stride_vblk + slot * stride_vtok + v_head_off)[:, None] + dw[None, :]
    if MASKED and V_WORD == 1:
        w = tl.load(v_ptrs, mask=in_ctx[:, None], other=0.0)
    elif MASKED:
        w = tl.load(v_ptrs, mask=in_ctx[:, None], other=0)
    else:
        w = tl.load(v_ptrs)
    if V_WORD == 1:  # the plugin's path: fp8 bytes cast to the queries' dtype
        a0 = a0 * alpha[:, None] + tl.dot(p.to(q.dtype), w.to(q.dtype))
    else:
        pv = p.to(q.dtype)
        if UNPACK == 2:
            if V_WORD == 4:
                v0, v1, v2, v3 = _asm_quad(w, E5M2)
            else:
                v0, v1 = _asm_pair(w, E5M2)
        else:
            w = w.to(tl.int32)  # 16-bit words: sign-extended, the byte masks drop the sign
            v0 = _residue_fp16(w, 0, E5M2, UNPACK)
            v1 = _residue_fp16(w, 1, E5M2, UNPACK)
            if V_WORD == 4:
                v2 = _residue_fp16(w, 2, E5M2, UNPACK)
                v3 = _residue_fp16(w, 3, E5M2, UNPACK)
        a0 = a0 * alpha[:, None] + tl.dot(pv, v0.to(q.dtype))
        a1 = a1 * alpha[:, None] + tl.dot(pv, v1.to(q.dtype))
        if V_WORD == 4:
            a2 = a2 * alpha[:, None] + tl.dot(pv, v2.to(q.dtype))
            a3 = a3 * alpha[:, None] + tl.dot(pv, v3.to(q.dtype))
    return m_new, l_i, a0, a1, a2, a3


@triton.jit
def _store_residue(out_ptr, partial_out_ptr, acc, inv_l, req, head, row_valid, split, num_tokens,
                   num_heads, stride_o_t, stride_o_h,
                   J: tl.constexpr, HEAD: tl.constexpr, V_WORD: tl.constexpr,
                   NUM_SPLITS: tl.constexpr):
    col = tl.arange(0, HEAD // V_WORD) * V_WORD + J
    out = acc * inv_l[:, None]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + req * stride_o_t + head[:, None] * stride_o_h + col[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
    else:
        row = (split * num_tokens + req) * num_heads + head
        tl.store(partial_out_ptr + row[:, None] * HEAD + col[None, :], out,
                 mask=row_valid[:, None])


@triton.jit
def decode_words(
    out_ptr, q_ptr, k_ptr, v_ptr, block_table_ptr, seq_lens_ptr,
    partial_out_ptr, partial_lse_ptr, k_scale_ptr, v_scale_ptr, qk_scale,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_blk, stride_tok, stride_head, stride_vblk, stride_vtok, stride_vhead, stride_bt,
    num_tokens, num_heads,
    GROUP: tl.constexpr, HEAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr, V_WORD: tl.constexpr, UNPACK: tl.constexpr,
    E5M2: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    rows = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + rows % GROUP
    row_valid = rows < GROUP
    d = tl.arange(0, HEAD)
    q = tl.load(q_ptr + req * stride_q_t + head[:, None] * stride_q_h + d[None, :],
                mask=row_valid[:, None], other=0.0)
    qk_scale = qk_scale * tl.load(k_scale_ptr)
    if q.dtype == tl.bfloat16:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    a0 = tl.zeros([BLOCK_M, HEAD // V_WORD], tl.float32)
    a1 = tl.zeros([BLOCK_M, HEAD // V_WORD], tl.float32)
    a2 = tl.zeros([BLOCK_M, HEAD // V_WORD], tl.float32)
    a3 = tl.zeros([BLOCK_M, HEAD // V_WORD], tl.float32)
    kv_start = 0
    kv_end = seq_len
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_start = split * per_split
        kv_end = tl.minimum(kv_end, kv_start + per_split)
    unmasked_end = tl.maximum(kv_start, kv_end // BLOCK_N * BLOCK_N)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for start in range(kv_start, unmasked_end, BLOCK_N):
        m_i, l_i, a0, a1, a2, a3 = _decode_tile(
            q, m_i, l_i, a0, a1, a2, a3, k_ptr, v_ptr, bt_row, kv_head * stride_head,
            kv_head * stride_vhead, start, kv_end, qk_scale, stride_blk, stride_tok,
            stride_vblk, stride_vtok, False, BLOCK_N, PAGE, HEAD, V_WORD, UNPACK, E5M2)
    for start in range(unmasked_end, kv_end, BLOCK_N):
        m_i, l_i, a0, a1, a2, a3 = _decode_tile(
            q, m_i, l_i, a0, a1, a2, a3, k_ptr, v_ptr, bt_row, kv_head * stride_head,
            kv_head * stride_vhead, start, kv_end, qk_scale, stride_blk, stride_tok,
            stride_vblk, stride_vtok, True, BLOCK_N, PAGE, HEAD, V_WORD, UNPACK, E5M2)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    v_scale = tl.load(v_scale_ptr)
    if UNPACK == 1 and not E5M2 and V_WORD > 1:
        v_scale = v_scale * 256.0  # the integer unpacking's e4m3 values are 2^-8 too small
    inv_l = v_scale / l_safe
    _store_residue(out_ptr, partial_out_ptr, a0, inv_l, req, head, row_valid, split, num_tokens,
                   num_heads, stride_o_t, stride_o_h, 0, HEAD, V_WORD, NUM_SPLITS)
    if V_WORD > 1:
        _store_residue(out_ptr, partial_out_ptr, a1, inv_l, req, head, row_valid, split,
                       num_tokens, num_heads, stride_o_t, stride_o_h, 1, HEAD, V_WORD, NUM_SPLITS)
    if V_WORD == 4:
        _store_residue(out_ptr, partial_out_ptr, a2, inv_l, req, head, row_valid, split,
                       num_tokens, num_heads, stride_o_t, stride_o_h, 2, HEAD, V_WORD, NUM_SPLITS)
        _store_residue(out_ptr, partial_out_ptr, a3, inv_l, req, head, row_valid, split,
                       num_tokens, num_heads, stride_o_t, stride_o_h, 3, HEAD, V_WORD, NUM_SPLITS)
    if NUM_SPLITS > 1:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(partial_lse_ptr + (split * num_tokens + req) * num_heads + head, lse,
                 mask=row_valid)


# ---- cases, launches, reference -------------------------------------------------------------


@dataclass
class Case:
    name: str
    batch: int
    seq_len: int
    num_heads: int = 32
    num_kv_heads: int = 8
    splits: int | None = None  # None: the plugin's choice

    def kv_bytes(self, itemsize: int) -> int:
        return self.batch * self.seq_len * self.num_kv_heads * HEAD * 2 * itemsize


GPU_CASES = [
    Case("decode 64x2048", 64, 2048),
    Case("decode 1x32k", 1, 32768),
    Case("decode 4x32k", 4, 32768),
    Case("decode 64x2048 gqa 32/4", 64, 2048, num_kv_heads=4),
    Case("decode 256x1024 gqa 16/8", 256, 1024, num_heads=16),
]
CPU_CASES = [
    Case("decode 3x45", 3, 45, num_heads=4, num_kv_heads=2),
    Case("decode 2x70 gqa 8/2, 3 splits", 2, 70, num_heads=8, num_kv_heads=2, splits=3),
]


@dataclass(frozen=True)
class Variant:
    name: str
    v_word: int  # 1: V as bytes; 2 or 4: V as words
    unpack: str = "cvt"
    plugin: bool = False  # the installed plugin's kernel, not this file's
    grid: int = 1  # how many GRID configurations the headline tries


class Bench:
    """A random paged fp8 cache (random page order) for one case, its bf16 twin holding the
    same values times the scales, and the float64 reference."""

    def __init__(self, case: Case, fp8: torch.dtype, dtype: torch.dtype, device: str) -> None:
        self.case, self.fp8, self.dtype, self.device = case, fp8, dtype, device
        g = torch.Generator(device).manual_seed(0)
        pages_per_req = math.ceil(case.seq_len / PAGE)
        num_pages = case.batch * pages_per_req
        perm = torch.randperm(num_pages, generator=g, device=device).int()
        self.block_table = perm.view(case.batch, pages_per_req)
        self.seq_lens = torch.full((case.batch,), case.seq_len, dtype=torch.int32, device=device)
        self.qsl = torch.arange(case.batch + 1, dtype=torch.int32, device=device)
        shape = (2, num_pages, PAGE, case.num_kv_heads, HEAD)
        self.cache = torch.randn(shape, generator=g, device=device).to(fp8)
        scales = torch.tensor([K_SCALE, V_SCALE], device=device).view(2, 1, 1, 1, 1)
        self.cache_full = (self.cache.to(torch.float32) * scales).to(dtype)
        self.k_scale = torch.tensor(K_SCALE, device=device)
        self.v_scale = torch.tensor(V_SCALE, device=device)
        self.one = torch.ones((), device=device)
        self.q = torch.randn(case.batch, case.num_heads, HEAD, generator=g, device=device,
                             dtype=dtype)
        self.ref = self.reference()

    def reference(self) -> torch.Tensor:
        c = self.case
        bt = self.block_table.long()  # gathered as bytes: fp8 indexing is not everywhere
        kv = self.cache.view(torch.uint8)[:, bt].view(self.fp8).to(torch.float64)
        kv = kv.reshape(2, c.batch, -1, c.num_kv_heads, HEAD)[:, :, : c.seq_len]
        q = self.q.double().view(c.batch, c.num_kv_heads, -1, HEAD)  # [B, kv head, group, d]
        s = torch.einsum("bhgd,bshd->bhgs", q, kv[0]) * (K_SCALE * HEAD**-0.5)
        out = torch.einsum("bhgs,bshd->bhgd", s.softmax(-1), kv[1]) * V_SCALE
        return out.reshape(c.batch, c.num_heads, HEAD)

    def config(self, block_n: int | None = None, warps: int | None = None,
               stages: int | None = None, kv_bytes: int = 1):
        c = self.case
        base = choose_kernel_config(
            num_reqs=c.batch, max_query_len=1, max_seq_len=c.seq_len,
            num_kv_heads=c.num_kv_heads, group=c.num_heads // c.num_kv_heads, head_size=HEAD,
            num_sms=(torch.cuda.get_device_properties(0).multi_processor_count
                     if self.device == "cuda" else 4),
            on_gpu=self.device == "cuda", kv_bytes=kv_bytes)
        return (base.block_m, block_n or base.block_n, warps or base.num_warps,
                stages or base.num_stages, c.splits or base.num_splits)

    def launcher(self, variant: Variant | None, cfg) -> tuple[Callable[[], torch.Tensor], dict]:
        """A no-argument call of one attention step (kernel and split merge), and a dict that
        holds its compiled attention kernel after the first call; ``variant`` None is the
        plugin's bf16 kernel."""
        c = self.case
        block_m, block_n, warps, stages, splits = cfg
        group = c.num_heads // c.num_kv_heads
        out = torch.empty_like(self.q)
        partial = torch.empty(splits * c.batch * c.num_heads * HEAD, dtype=torch.float32,
                              device=self.device)
        lse = torch.empty(splits * c.batch * c.num_heads, dtype=torch.float32,
                          device=self.device)
        grid = (c.batch, c.num_kv_heads, splits)
        qk_scale = HEAD**-0.5 * LOG2E
        q = self.q
        kernels: dict = {}  # the compiled attention kernel, once launched (registers, spills)

        def merge():
            if splits > 1:
                plugin_kernels.merge_splits[(c.batch, c.num_heads)](
                    out, partial, lse, out.stride(0), out.stride(1), c.batch, c.num_heads,
                    HEAD_DIM=HEAD, HEAD_PAD=HEAD, NUM_SPLITS=splits,
                    SPLITS_PAD=max(2, triton.next_power_of_2(splits)))
            return out

        if variant is None or variant.plugin:
            fp8 = variant is not None
            cache = self.cache if fp8 else self.cache_full
            kc, vc = cache.unbind(0)
            ks, vs = (self.k_scale, self.v_scale) if fp8 else (self.one, self.one)
            # The words path integrated in the plugin (branch wip-fp8), when installed.
            words = {} if variant is None or variant.v_word == 1 else dict(
                V_WORD=variant.v_word, ASM_CVT=variant.unpack == "asm")
            if words:
                vc = vc.view(torch.int32 if variant.v_word == 4 else torch.int16)

            def call():
                kernels["attention"] = plugin_kernels.paged_attention[grid](
                    out, q, kc, vc, self.block_table, self.seq_lens, self.qsl,
                    self.seq_lens, self.seq_lens, partial, lse, ks, vs, qk_scale, 0.0,
                    q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                    kc.stride(0), kc.stride(1), kc.stride(2), self.block_table.stride(0),
                    c.batch, c.num_heads,
                    GROUP=group, HEAD_DIM=HEAD, HEAD_PAD=HEAD, BLOCK_Q=1, BLOCK_M=block_m,
                    BLOCK_N=block_n, PAGE=PAGE, USE_SOFTCAP=False, WINDOW=0,
                    NUM_SPLITS=splits, DECODE=True, FP8=fp8, **words,
                    num_warps=warps, num_stages=stages)
                return merge()
            return call, kernels

        kc, vc = self.cache.unbind(0)
        if variant.v_word > 1:
            vc = vc.view(torch.int32 if variant.v_word == 4 else torch.int16)

        def call():
            kernels["attention"] = decode_words[grid](
                out, q, kc, vc, self.block_table, self.seq_lens, partial, lse,
                self.k_scale, self.v_scale, qk_scale,
                q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1),
                vc.stride(2), self.block_table.stride(0), c.batch, c.num_heads,
                GROUP=group, HEAD=HEAD, BLOCK_M=block_m, BLOCK_N=block_n, PAGE=PAGE,
                NUM_SPLITS=splits, V_WORD=variant.v_word, UNPACK=UNPACK[variant.unpack],
                E5M2=self.fp8 == torch.float8_e5m2, num_warps=warps, num_stages=stages)
            return merge()
        return call, kernels


def time_us(fn, rep_ms: int) -> float:
    """Device time of one call, replayed from a CUDA graph: ``benchmarks/attention.py``'s
    ``time_us`` with a shorter measuring time (its 100 ms per row would not fit 3 minutes)."""
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=rep_ms) * 1000


# (BLOCK_N, warps, stages) tried on the headline shape; the plugin's fp8 tile first.
GRID = [(128, 4, 3), (128, 4, 2), (128, 8, 3), (64, 4, 3), (256, 4, 2), (256, 8, 2)]
PLUGIN_WORDS = "V_WORD" in plugin_kernels.paged_attention.arg_names
VARIANTS = [
    # The installed plugin's kernel at its fp8 tile, words read as integrated on wip-fp8.
    *([Variant("plugin w2-asm", 2, "asm", plugin=True),
       Variant("plugin w4-asm", 4, "asm", plugin=True),
       Variant("plugin w2-cvt", 2, "cvt", plugin=True),
       Variant("plugin w4-cvt", 4, "cvt", plugin=True)] if PLUGIN_WORDS else []),
    Variant("bytes", 1),  # this file's kernel reading bytes: should time as the plugin's fp8
    Variant("w2-asm", 2, "asm", grid=len(GRID)),
    Variant("w4-asm", 4, "asm", grid=len(GRID)),
    Variant("w2-cvt", 2, "cvt", grid=3),
    Variant("w4-cvt", 4, "cvt", grid=3),
    Variant("w2-int", 2, "int"),
    Variant("w4-int", 4, "int"),
]
# Past this many seconds, the shapes after the headline get the plugin's rows and the best
# variant only.
LATE_S = 150.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu", action="store_true", help="interpreter, tiny shapes")
    parser.add_argument("--e5m2", action="store_true", help="fp8 e5m2 instead of e4m3")
    parser.add_argument("--budget-s", type=float, default=90.0,
                        help="stop trying headline configurations after this many seconds")
    parser.add_argument("--rep-ms", type=int, default=30, help="measuring time per row")
    args = parser.parse_args()
    began = time.time()
    fp8 = torch.float8_e5m2 if args.e5m2 else torch.float8_e4m3fn
    device = "cpu" if args.cpu else "cuda"
    # The interpreter computes bf16 wrongly: float32 queries there (tight errors).
    dtype = torch.float32 if args.cpu else torch.bfloat16
    print(f"# fp8 decode variants, {str(fp8).removeprefix('torch.')}, "
          + ("CPU interpreter" if args.cpu else torch.cuda.get_device_name()))
    print("| shape | kernel | n w s x | us | TB/s | vs bf16 | max abs err | regs |")
    print("|---|---|---|---|---|---|---|---|")
    best: dict[str, tuple[float, tuple[int, int, int]]] = {}
    for i, case in enumerate(CPU_CASES if args.cpu else GPU_CASES):
        sweep_case(Bench(case, fp8, dtype, device), args, best, i == 0 and not args.cpu,
                   began)
        if not args.cpu:
            torch.cuda.empty_cache()
    print(f"# {time.time() - began:.0f} s; TB/s counts each cache's bytes "
          "(fp8: half of bf16); times exclude the K/V write launch.")


def sweep_case(bench: Bench, args: argparse.Namespace,
               best: dict[str, tuple[float, tuple[int, int, int]]], headline: bool,
               began: float) -> None:
    """The rows of one case: baselines, then every variant over the grid (``headline``, which
    records each variant's best time and configuration in ``best``) or at its best
    configuration."""
    case = bench.case
    times: list[float] = []

    def run(label: str, variant: Variant | None, cfg: tuple, bytes_per: int) -> float | None:
        try:
            fn, kernels = bench.launcher(variant, cfg)
            err = (fn().double() - bench.ref).abs().max().item()
            compiled = kernels.get("attention")
            regs = (f"{compiled.n_regs}" + (f"+{compiled.n_spills} spilled" if compiled.n_spills
                                            else "")) if hasattr(compiled, "n_regs") else "-"
            us = float("nan") if args.cpu else time_us(fn, args.rep_ms)
        except Exception as exc:  # a variant that does not compile is reported, not fatal
            first = str(exc).splitlines()[0][:100] if str(exc) else ""
            print(f"| {case.name} | {label} | {cfg_str(cfg)} | failed: {type(exc).__name__}: "
                  f"{first} | | | | |", flush=True)
            return None
        times.append(us)
        emit(case, label, cfg, us, err, bytes_per, times[0], regs)  # times[0]: bf16
        return us

    run(f"{str(bench.dtype).removeprefix('torch.')} (plugin)", None, bench.config(kv_bytes=2), 2)
    run(f"{str(bench.fp8).removeprefix('torch.')} (plugin)", Variant("plugin", 1, plugin=True),
        bench.config(), 1)
    overall = min(((us, name) for name, (us, _) in best.items() if "plugin" not in name),
                  default=(0.0, ""))[1]
    for variant in VARIANTS:
        if args.cpu and variant.unpack == "asm":  # the interpreter cannot run PTX
            continue
        if variant.plugin:
            run(variant.name, variant, bench.config(), 1)
            continue
        if not headline:
            late = not args.cpu and time.time() - began > LATE_S and variant.name != overall
            if not args.cpu and (variant.name not in best or variant.v_word == 1 or late):
                continue  # bytes: the headline alone checks this file's kernel
            cfg = best[variant.name][1] if variant.name in best else (None, None, None)
            run(variant.name, variant, bench.config(*cfg), 1)
            continue
        timed = []
        for n, w, s in GRID[: variant.grid]:
            if time.time() - began > args.budget_s and timed:
                print(f"| {case.name} | {variant.name} | (budget spent: rest of the grid "
                      "skipped) | | | | | |")
                break
            us = run(variant.name, variant, bench.config(n, w, s), 1)
            if us is not None:
                timed.append((us, (n, w, s)))
        if timed:
            best[variant.name] = min(timed)


def cfg_str(cfg) -> str:
    _, n, w, s, x = cfg
    return f"{n} {w} {s} {x}"


def emit(case, label, cfg, us, err, bytes_per, bf16_us, regs) -> None:
    flag = " WRONG" if not err <= 2e-2 else ""
    if math.isnan(us):
        tbs = ratio = "-"
        us_s = "-"
    else:
        tbs = f"{case.kv_bytes(bytes_per) / us / 1e6:.2f}"
        ratio = f"{us / bf16_us:.3f}x"
        us_s = f"{us:.1f}"
    print(f"| {case.name} | {label} | {cfg_str(cfg)} | {us_s} | {tbs} | {ratio} | "
          f"{err:.1e}{flag} | {regs} |", flush=True)


if __name__ == "__main__":
    main()
