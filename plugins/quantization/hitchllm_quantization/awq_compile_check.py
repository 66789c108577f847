"""Compile the AWQ kernels for an sm_90 (H100) target without a GPU: Triton's compiler and
``ptxas`` run on any machine, so invalid tile shapes, layouts or shared-memory overflows show
up on the CPU too. ``python -m hitchllm_quantization.awq_compile_check [--all]`` compiles the
first autotuning config of each path (``--all``: every one) for two group sizes and prints the
shared memory each needs; it must run with ``TRITON_INTERPRET`` unset."""

from __future__ import annotations

import argparse
import os

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

H100 = GPUTarget("cuda", 90, 32)
SHARED_MEMORY = 227 * 1024  # per block on an H100
POINTERS = {"x_ptr": "*bf16", "qweight_ptr": "*i32", "qzeros_ptr": "*i32",
            "scales_ptr": "*fp16"}


def compile_config(path: str, config: triton.Config, group_size: int) -> int:
    """Compile ``path``'s kernel with ``config``; returns its shared memory in bytes."""
    from hitchllm_quantization.awq_triton import PATHS

    kernel, _, atomic = PATHS[path]
    constexprs = dict(config.kwargs, GROUP_SIZE=group_size)
    if path != "gemv":
        constexprs |= {"ATOMIC": atomic, "DOT_PRECISION": "tf32"}
    types = POINTERS | {"out_ptr": "*fp32" if atomic else "*bf16"}
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(names.index(n),): v for n, v in constexprs.items()})
    compiled = triton.compile(source, target=H100, options={
        "num_warps": config.num_warps, "num_stages": config.num_stages})
    return compiled.metadata.shared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--all", action="store_true", help="every autotuning config")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") != "0":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter does not compile kernels")
    from hitchllm_quantization.awq_triton import GEMV_CONFIGS, SPLIT_K_CONFIGS, TILE_CONFIGS

    for path, configs in (("gemv", GEMV_CONFIGS), ("split_k", SPLIT_K_CONFIGS),
                          ("tiles", TILE_CONFIGS)):
        for config in configs if args.all else configs[:1]:
            for group_size in (128, 32):
                shared = compile_config(path, config, group_size)
                fits = "fits" if shared <= SHARED_MEMORY else "TOO MUCH shared memory"
                print(f"{path} {config} group {group_size}: {shared} bytes shared, {fits}")


if __name__ == "__main__":
    main()
