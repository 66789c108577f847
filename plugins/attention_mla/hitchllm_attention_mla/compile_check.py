"""Compile TRITON_MLA's kernels for GPUs without one: the decode kernel with the H100 tiles
(sm_90, ``triton_mla.LARGE_SMEM_TILES``) and the A100 tiles (sm_80, ``SMALL_SMEM_TILES``) at
DeepSeek-V3 dims, the Hopper Gluon kernel (``HOPPER_TILES``), and the split merge, each
against the shared memory its tiles were chosen for. ``python -m
hitchllm_attention_mla.compile_check`` prints one line per kernel, ending in "fits" or "TOO
MUCH shared memory"; it must run with ``TRITON_INTERPRET`` unset."""

from __future__ import annotations

import os

from hitchllm.attention.triton_support import compile_for_gpu
from hitchllm_attention_mla.triton_mla import (
    LARGE_SMEM_BYTES,
    LARGE_SMEM_TILES,
    MERGE_BLOCK_O,
    SMALL_SMEM_TILES,
    MLADecodeTiles,
)

#: DeepSeek-V3's latent width and rope dims (the kernel's BLOCK_L and BLOCK_R).
KV_LORA_RANK, ROPE = 512, 64
#: Shared memory per block of an A100 (sm_80), which the small tiles are for, and of an
#: H100 (sm_90), the Gluon kernel's.
A100_SHARED_MEMORY = 163 * 1024
H100_SHARED_MEMORY = 227 * 1024
FLOATS = {"acc_ptr": "*fp32", "stats_ptr": "*fp32", "scale": "fp32"}
#: The decode kernels' arguments for bf16 queries and cache and int32 tables and lengths.
DECODE_TYPES = FLOATS | {"q_ptr": "*bf16", "cache_ptr": "*bf16", "block_table_ptr": "*i32",
                         "seq_lens_ptr": "*i32"}


def compile_decode(tiles: MLADecodeTiles, capability: int, page: int = 64):
    """The decode kernel with ``tiles`` for bf16 queries and a bf16 cache of ``page``-token
    pages."""
    from hitchllm_attention_mla.triton_mla_kernel import mla_decode_partials

    constexprs = {"KV_LORA_RANK": KV_LORA_RANK, "WIDTH": KV_LORA_RANK + ROPE, "PAGE": page,
                  "BLOCK_H": tiles.block_h, "BLOCK_N": tiles.block_n, "BLOCK_L": KV_LORA_RANK,
                  "BLOCK_R": ROPE, "BLOCK_O": tiles.block_o}
    # At DeepSeek-V3 dims every pointer, stride and size is divisible by 16, which Triton notes
    # at launch (so its loads vectorize and pipeline the same way here).
    aligned = set(mla_decode_partials.arg_names) - {"scale"}
    return compile_for_gpu(mla_decode_partials, constexprs, DECODE_TYPES, aligned, tiles.num_warps,
                           tiles.num_stages, capability)


def compile_decode_gluon(page: int = 64, lengths: str = "*i32", acc: str = "*fp32"):
    """The Hopper (sm_90) Gluon decode kernel for bf16 queries and cache, context lengths of
    type ``lengths`` (the engine passes int32; ``mla_decode`` takes int64 too) and partial
    outputs of type ``acc`` (float32 with splits, the model dtype with one), specialized as a
    launch specializes it (the row statistics' strides not at all)."""
    from hitchllm_attention_mla import gluon_mla_kernel as g

    kernel = g.mla_decode_partials_sm90
    constexprs = {"KV_LORA_RANK": KV_LORA_RANK, "WIDTH": KV_LORA_RANK + ROPE, "PAGE": page,
                  "BLOCK_H": g.BLOCK_H, "BLOCK_N": g.BLOCK_N}
    types = DECODE_TYPES | {"seq_lens_ptr": lengths, "acc_ptr": acc}
    aligned = set(kernel.arg_names) - {"scale", *g.UNSPECIALIZED}
    return compile_for_gpu(kernel, constexprs, types, aligned, g.LAUNCH_WARPS, 1, 90)


def compile_merge(capability: int):
    """The split merge for a bf16 output and up to 128 splits."""
    from hitchllm_attention_mla.triton_mla_kernel import mla_merge_splits

    constexprs = {"BLOCK_S": 128, "BLOCK_O": MERGE_BLOCK_O}
    types = FLOATS | {"out_ptr": "*bf16"}
    aligned = {n for n in mla_merge_splits.arg_names if n.endswith("_ptr")}
    return compile_for_gpu(mla_merge_splits, constexprs, types, aligned, 4, 2, capability)


def main() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") != "0":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter does not compile kernels")
    for name, compiled, limit in (
            ("decode sm_90", compile_decode(LARGE_SMEM_TILES, 90), LARGE_SMEM_BYTES),
            ("decode sm_90 Gluon", compile_decode_gluon(), H100_SHARED_MEMORY),
            ("decode sm_90 Gluon, page 16, int64 lengths", compile_decode_gluon(16, "*i64"),
             H100_SHARED_MEMORY),
            ("decode sm_90 Gluon, one split (bf16 output)",
             compile_decode_gluon(acc="*bf16"), H100_SHARED_MEMORY),
            ("decode sm_80", compile_decode(SMALL_SMEM_TILES, 80), A100_SHARED_MEMORY),
            ("merge sm_90", compile_merge(90), A100_SHARED_MEMORY)):
        shared = compiled.metadata.shared
        fits = "fits" if shared <= limit else "TOO MUCH shared memory"
        print(f"{name}: {shared} bytes shared of {limit}, {fits}")


if __name__ == "__main__":
    main()
