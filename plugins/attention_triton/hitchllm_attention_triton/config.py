"""Launch configurations: tile sizes, warps, pipeline stages and the split-KV decision.

Chosen on the host once per step from the batch's shape. The numbers for CUDA were tuned on an
H100 (see benchmarks/attention.py and docs/backends.md); the CPU interpreter gets the smallest
tiles so tests stay fast.
"""

from __future__ import annotations

from dataclasses import dataclass

# Queries up to this long (speculative verification's) get tiles sized to the query.
SHORT_QUERY = 8


@dataclass(frozen=True)
class KernelConfig:
    block_q: int  # query tokens per program
    block_m: int  # rows per program: block_q * group, rounded up to a power of two >= 16
    block_n: int  # context tokens per inner-loop tile
    num_warps: int
    num_stages: int
    num_splits: int  # > 1: split-KV ("flash decoding")
    # fp8 cache: V read as words of this many fp8 values (1: as bytes; 2 or 4: one dot per
    # byte residue of the head dimension, see kernels.py)
    v_word: int = 1


def _pow2_at_least(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def choose_kernel_config(
    num_reqs: int, max_query_len: int, max_seq_len: int, num_kv_heads: int, group: int,
    head_size: int, num_sms: int, on_gpu: bool, force_splits: int | None = None,
    kv_bytes: int = 2,
) -> KernelConfig:
    """The configuration for one step's batch; ``kv_bytes`` is the cache's bytes per element
    (1 for fp8)."""
    decode_only = max_query_len == 1
    # fp8 V in words of two values reaches the tensor cores through 16-bit shared loads instead
    # of one load per byte (TUNING.md entry 9): decode-sized tiles (prefill tiles are not
    # measured yet) whose two residue dots get 16 columns or more. Two values, not four: at
    # BLOCK_N 128 the 16-bit words compile to 128 registers or fewer on every measured decode
    # shape (4 programs per SM, what set the fast rows apart), 32-bit words to up to 146
    # (TUNING.md entry 10).
    v_word = 2 if kv_bytes == 1 and head_size % 2 == 0 and head_size > 16 else 1
    if decode_only:
        block_m = max(16, _pow2_at_least(group))
        block_q = 1
        # An fp8 tile of twice the tokens moves the bytes per iteration that the tuned bf16
        # tile does.
        block_n = (128 if kv_bytes == 1 else 64) if on_gpu else 16
        num_warps, num_stages = 4, 3
    elif on_gpu and max_query_len <= SHORT_QUERY:
        # Speculative verification (a request's newest token and a few drafts): tiles sized to
        # the query, as decode's are, instead of a prefill tile mostly of padding rows.
        block_m = max(16, _pow2_at_least(max_query_len * group))
        block_q = block_m // group
        block_n = 128 if kv_bytes == 1 else 64
        num_warps, num_stages = 4, 3
    else:
        block_m = 128 if on_gpu else 16
        block_m = max(block_m, _pow2_at_least(group))
        block_q = max(1, block_m // group)
        block_n = 32 if on_gpu else 16
        num_warps, num_stages = (8, 2) if on_gpu else (4, 1)
        v_word = 1
        if on_gpu and head_size > 128:  # keep the [BLOCK_M, head] accumulator in registers
            block_m = max(64, _pow2_at_least(group))
            block_q = max(1, block_m // group)
    splits = 1
    if force_splits is not None:
        splits = force_splits
    elif decode_only and on_gpu:
        programs = max(1, num_reqs * num_kv_heads)
        # Split when the batch alone leaves SMs short of work and contexts are long. fp8 (tuned
        # to its own tile): under two waves of SMs, rounded up. bf16/fp16: as many ranges as
        # four waves hold, rounded down, and more than 8 only while they stay within two waves
        # (H100, Qwen3-0.6B's 8 KV heads, the throughput run's contexts; RESULTS.md, session of
        # 2026-11-28 (fourth): 16 at 2 requests, 8 at 4-8, 4 at 16, 2 at 24-32, none from 48
        # were each the best or within 3% of the best of the grid).
        if kv_bytes == 1:
            share = -(-2 * num_sms // programs) if programs < 2 * num_sms else 1
        else:
            share = 4 * num_sms // programs
            if share > 8:
                share = max(8, 2 * num_sms // programs)
        splits = max(1, min(share, max_seq_len // (4 * block_n), 64))
        # A power of two: the count is a constexpr, and each distinct value is a kernel compile
        # of its own. Exact counts took up to ~30 values as batches shrank and contexts grew,
        # and eager steps stalled on the compiles (an 8B model's eager throughput run spent
        # most of its time there); seven values cover them all.
        splits = 1 << (splits.bit_length() - 1)
        if kv_bytes > 1:
            # Tiles of 128 tokens where four waves or fewer of programs each walk one or two
            # long ranges (the grid's best at 24-64 requests; from 80 on, 64 and 128 were
            # within 1-2% and 64 stays), for heads up to 128 (a larger head doubles the tile's
            # shared memory, not measured). Two pipeline stages below 12 waves: the grid's
            # best at every size from 4 to 160 requests, while three measured 0.4% faster at
            # 192-256 in whole runs.
            if (splits <= 2 and programs * splits <= 4 * num_sms and head_size <= 128
                    and max_seq_len >= splits * 4 * 128):
                block_n = 128
            num_stages = 2 if programs * splits < 12 * num_sms else 3
    return KernelConfig(block_q, block_m, block_n, num_warps, num_stages, max(1, splits), v_word)
