"""A process that builds many engines must never hard-fail because of compilation: past
dynamo's recompile limit, new argument kinds of a fused function run eagerly (the same
arithmetic) and the kinds compiled before stay compiled."""

from __future__ import annotations

import logging

import torch
from torch._dynamo import config as dynamo_config

from hitchllm.models import fused


def test_recompile_limit_falls_back_to_eager(caplog):
    def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return fused._normalize(x, weight, eps)

    # Compiled on the CPU here (on CUDA in the engine); the limit is lowered so that the third
    # dtype passes it, as many engines of different dtypes in one process would.
    norm_fused = fused._fused(norm, lambda x: True)
    torch._dynamo.reset()
    kinds = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
    with dynamo_config.patch(recompile_limit=2), caplog.at_level(logging.WARNING):
        for _ in range(2):
            for dtype in kinds:
                x = torch.randn(5, 16, dtype=dtype)
                w = torch.randn(16, dtype=dtype)
                out = norm_fused(x, w, 1e-6)
                torch.testing.assert_close(out, fused._normalize(x, w, 1e-6))
    # Without the fallback the third kind raised FailOnRecompileLimitHit (fullgraph=True).
    warnings = [r for r in caplog.records if "recompile limit" in r.getMessage()]
    assert len(warnings) == 1


def test_a_device_kernel_call_never_stands_in_for_the_loaded_kernel():
    """A function with both a plugin's device kernel (a device its own route does not apply
    to) and a loaded kernel (where it does, CUDA in the engine) calls each on its own device:
    a CPU call first must not make later calls on the other route run the CPU kernel."""
    calls = []

    def rotary(x: torch.Tensor) -> torch.Tensor:
        return x

    fused.register_device_kernels("cpu", {"rotary": lambda x: calls.append("cpu") or x})
    try:
        # float64 stands for the route's device here (``applies``), float32 for the other.
        run = fused._fused(rotary, lambda x: x.dtype == torch.float64,
                           lambda: lambda x: calls.append("loaded") or x)
        run(torch.zeros(2))
        run(torch.zeros(2, dtype=torch.float64))
        run(torch.zeros(2))
        run(torch.zeros(2, dtype=torch.float64))
    finally:
        fused.unregister_device_kernels("cpu")
    assert calls == ["cpu", "loaded", "cpu", "loaded"]
