"""Compile the AWQ kernels for an sm_90 (H100) target without a GPU: Triton's compiler and
``ptxas`` run on any machine, so invalid tile shapes, layouts or shared-memory overflows show
up on the CPU too. ``python -m hitchllm_quantization.awq_compile_check [--all]`` compiles the
first autotuning config of each path (``--all``: every one) for two group sizes and prints the
shared memory each needs; it must run with ``TRITON_INTERPRET`` unset."""

from __future__ import annotations

import argparse
import os

import triton

from hitchllm.attention.triton_support import compile_for_gpu

SHARED_MEMORY = 227 * 1024
ALIGNED = ("N", "K", "stride_xm", "stride_om")  # per block on an H100
POINTERS = {"x_ptr": "*bf16", "qweight_ptr": "*i32", "zeros_ptr": "*u8",
            "scales_ptr": "*fp16"}


def compile_config(path: str, config: triton.Config, group_size: int):
    """Compile ``path``'s kernel with ``config`` for an H100: the compiled kernel (its
    ``metadata.shared`` the shared memory in bytes, ``asm`` the PTX and cubin)."""
    from hitchllm_quantization.awq_triton import PATHS

    kernel = PATHS[path][0]
    # Contiguous rows, as Triton specializes a stride of 1 at launch.
    constexprs = dict(config.kwargs, GROUP_SIZE=group_size, PTX=True, stride_xk=1, stride_on=1)
    if path != "gemv":
        constexprs["DOT_PRECISION"] = "tf32"
    atomic = config.kwargs["SPLIT_K"] > 1
    types = POINTERS | {"out_ptr": "*fp32" if atomic else "*bf16"}
    # Pointers, sizes and row strides divisible by 16, as Triton notes at launch for a
    # Llama-shaped layer: its loads vectorize the same way here.
    aligned = {n for n in kernel.arg_names if n.endswith("_ptr") or n in ALIGNED}
    return compile_for_gpu(kernel, constexprs, types, aligned, config.num_warps,
                           config.num_stages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--all", action="store_true", help="every autotuning config")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") != "0":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter does not compile kernels")
    from hitchllm_quantization.awq_triton import SMALL_DOT_CONFIGS, TILE_CONFIGS, gemv_config

    for path, configs in (("gemv", None), ("split_k", SMALL_DOT_CONFIGS), ("tiles", TILE_CONFIGS)):
        for group_size in (128, 32):
            if configs is None:  # the GEMV's rule, at a Llama-8B down projection
                tile = gemv_config(4096, 14336, group_size)
                warps, stages = tile.pop("num_warps"), tile.pop("num_stages")
                chosen = [triton.Config(tile, num_warps=warps, num_stages=stages)]
            else:
                chosen = configs if args.all else configs[:1]
            for config in chosen:
                shared = compile_config(path, config, group_size).metadata.shared
                fits = "fits" if shared <= SHARED_MEMORY else "TOO MUCH shared memory"
                print(f"{path} {config} group {group_size}: {shared} bytes shared, {fits}")


if __name__ == "__main__":
    main()
