"""Entry point of the plugin: registers CPU_ATTN with hitchllm, and the CPU kernels of the
fused elementwise functions (``hitchllm_attention_cpu.fused``) once a CPU model is loaded."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from hitchllm import hookimpl
from hitchllm.attention import AttentionBackend

if TYPE_CHECKING:
    from hitchllm import EngineConfig

logger = logging.getLogger(__name__)


@hookimpl
def hitchllm_attention_backends() -> list[type[AttentionBackend]]:
    """CPU_ATTN; importing the backend compiles nothing (validate builds the kernel)."""
    from hitchllm_attention_cpu.backend import CpuAttentionBackend

    return [CpuAttentionBackend]


@hookimpl
def hitchllm_model_loaded(model: torch.nn.Module, engine_config: EngineConfig) -> None:
    """On a CPU model with fusion on (``enable_fusion``), register the C versions of the
    fused functions, and in bfloat16 on a CPU with AMX give the linear layers the AMX kernel
    for decode-sized calls and the decoder layers their decode-step kernel (each built on
    first use; where one cannot be built, PyTorch's path stays, with a warning); in float32,
    MKL's packed GEMM for 16-32 rows and the decode-step kernel over MKL's GEMMs."""
    if not engine_config.enable_fusion:
        return
    first = next(iter(model.parameters()), None)
    if first is None or first.device.type != "cpu":
        return
    from hitchllm_attention_cpu import amx_linear, fused, mkl_linear
    from hitchllm_attention_cpu.compiler import KernelBuildError

    try:
        fused.install()
    except KernelBuildError as err:
        logger.warning("the CPU's fused elementwise kernels are unavailable (%s); the model's "
                       "norms, rotary and SiLU run in PyTorch", err)
        fused_kernels = False
    else:
        fused_kernels = True
    if first.dtype == torch.bfloat16:
        try:
            layers = amx_linear.install(model)
        except KernelBuildError as err:
            logger.warning("the AMX linear kernel is unavailable (%s); bfloat16 linears run "
                           "through oneDNN", err)
        else:
            logger.info("AMX kernel for %d bfloat16 linear layers of 1-%d rows", layers,
                        amx_linear.MAX_ROWS)
            if fused_kernels:  # the decode layer calls the fused and AMX kernels directly
                _install_decode_layers(model)
    elif first.dtype == torch.float32:
        layers = mkl_linear.install(model)
        logger.info("MKL packed GEMM for %d float32 linear layers of %d-%d rows", layers,
                    mkl_linear.MIN_ROWS, mkl_linear.PACKED_ROWS)
        if fused_kernels:  # the decode layer calls the fused kernels and MKL directly
            _install_decode_layers(model)


def _install_decode_layers(model: torch.nn.Module) -> None:
    from hitchllm_attention_cpu import decode_layer
    from hitchllm_attention_cpu.compiler import KernelBuildError

    try:
        count = decode_layer.install(model)
    except KernelBuildError as err:
        logger.warning("the decode layer's C code is unavailable (%s); decode steps run the "
                       "layers' modules", err)
    else:
        logger.info("%d decoder layers run decode steps in one C call", count)
