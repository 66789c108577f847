"""Entry point of the plugin: registers CPU_ATTN with hitchllm, and the CPU kernels of the
fused elementwise functions (``hitchllm_attention_cpu.fused``) once a CPU model is loaded."""

from __future__ import annotations

import logging

import torch

from hitchllm import hookimpl
from hitchllm.attention import AttentionBackend
from hitchllm.config import EngineConfig

logger = logging.getLogger(__name__)


@hookimpl
def hitchllm_attention_backends() -> list[type[AttentionBackend]]:
    """CPU_ATTN; importing the backend compiles nothing (validate builds the kernel)."""
    from hitchllm_attention_cpu.backend import CpuAttentionBackend

    return [CpuAttentionBackend]


@hookimpl
def hitchllm_model_loaded(model: torch.nn.Module, engine_config: EngineConfig) -> None:
    """On a CPU model with fusion on (``enable_fusion``), register the C versions of the
    fused functions (built on first use; where they cannot be built the functions run in
    PyTorch, with a warning)."""
    if not engine_config.enable_fusion:
        return
    first = next(iter(model.parameters()), None)
    if first is None or first.device.type != "cpu":
        return
    from hitchllm_attention_cpu.compiler import KernelBuildError
    from hitchllm_attention_cpu.fused import install

    try:
        install()
    except KernelBuildError as err:
        logger.warning("the CPU's fused elementwise kernels are unavailable (%s); the model's "
                       "norms, rotary and SiLU run in PyTorch", err)
