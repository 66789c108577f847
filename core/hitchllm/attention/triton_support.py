"""Triton as the engine and the backends written in it (TRITON_ATTN, TRITON_MLA, third-party
ones) use it: where its kernels can run (so that they refuse the same specs with the same
reasons), compiling a kernel for a GPU without one, and the on-disk cache its compiles share."""

from __future__ import annotations

import importlib.util
import os

import torch

from hitchllm.attention.backend import AttentionSpec


def triton_interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def pin_triton_cache_dir() -> None:
    """Keep this process's Triton compiles in one on-disk cache, where the next process finds
    them: sets ``TRITON_CACHE_DIR`` to Triton's own default when unset (every CUDA worker
    does, Ray's and worker processes' included). The variable stays set for the process, so
    Inductor's later compiles go there too; one Inductor set before the engine started is
    kept, as a user's is.

    Triton looks the variable up at every compile, and torch.compile's Inductor sets it, when
    unset, to a directory of its own the first time it builds a kernel in a process. A
    process that compiled its graphs therefore stored the kernels compiled after that point
    in Inductor's directory, and the next one, whose Inductor loaded those graphs from its
    cache without building a kernel, looked in Triton's default directory and compiled them
    all again: 12-18 s of an H100 engine's start-up (docs/performance.md, start-up)."""
    if "TRITON_CACHE_DIR" in os.environ or importlib.util.find_spec("triton") is None:
        return
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None:  # Triton's default (which honours TRITON_HOME)
        os.environ["TRITON_CACHE_DIR"] = knobs.cache.dir


def triton_device_reasons(spec: AttentionSpec) -> list[str]:
    """Why Triton kernels cannot run for ``spec``'s device and dtype (empty: they can): not
    installed; on CUDA, compute capability below 8.0 or a dtype other than bfloat16/float16;
    on a CPU, only in the interpreter and only in float32/float16; no other device."""
    if importlib.util.find_spec("triton") is None:
        return ["triton is not installed (pip install triton)"]
    reasons = []
    if spec.device_type == "cuda":
        if spec.device_capability is not None and spec.device_capability < (8, 0):
            reasons.append(f"compute capability {spec.device_capability} is below 8.0")
        if spec.dtype not in (torch.float16, torch.bfloat16):
            reasons.append(f"dtype {spec.dtype} is not supported on CUDA (use bfloat16 "
                           "or float16)")
    elif spec.device_type == "cpu":
        if not triton_interpreting():
            reasons.append("no CUDA device (on CPU the kernels only run in Triton's "
                           "interpreter, for testing: set TRITON_INTERPRET=1)")
        if spec.dtype not in (torch.float32, torch.float16):
            reasons.append(f"dtype {spec.dtype} is not supported by Triton's CPU "
                           "interpreter (use float32 or float16)")
    else:
        reasons.append(f"device type {spec.device_type!r} is not supported (CUDA only)")
    return reasons


def compile_for_gpu(kernel, constexprs: dict[str, object], types: dict[str, str],
                    aligned: set[str], num_warps: int, num_stages: int,
                    capability: int = 90):
    """Compile the ``@triton.jit`` (or ``@gluon.jit``) ``kernel`` for an NVIDIA GPU of
    ``capability`` (90: H100) without one: Triton's compiler and ``ptxas`` run on any
    machine, so tile shapes, layouts and shared memory that a real GPU rejects (and the
    interpreter accepts) show up on a CPU.
    ``constexprs`` binds the ``tl.constexpr`` arguments (and arguments Triton would specialize
    at launch, such as a stride of 1), ``types`` gives the other arguments' Triton types (the
    rest are ``i32``), ``aligned`` names those a launch would find divisible by 16. Returns
    the compiled kernel: ``metadata.shared`` is its shared memory in bytes, ``asm`` its PTX
    and cubin. Run with ``TRITON_INTERPRET`` unset."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if getattr(kernel, "is_gluon", lambda: False)():  # a @gluon.jit kernel
        try:  # Gluon's source class is private: it may move between Triton releases
            from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
        except ImportError as exc:
            raise RuntimeError(f"compile_for_gpu cannot compile Gluon kernels with Triton "
                               f"{triton.__version__} ({exc})") from exc
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if n in aligned and n not in constexprs}
    source = ASTSource(fn=kernel, signature=signature, attrs=attrs,
                       constexprs={(names.index(n),): v for n, v in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})
