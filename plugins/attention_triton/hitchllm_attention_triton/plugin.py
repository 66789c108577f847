"""Entry point of the plugin: registers TRITON_ATTN with hitchllm and puts the fused Triton
MoE kernel under the model's mixture-of-experts layers on CUDA."""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import TYPE_CHECKING

from torch import nn

from hitchllm import hookimpl
from hitchllm.attention import AttentionBackend
from hitchllm.layers import FusedMoE, UnquantizedMoEMethod

if TYPE_CHECKING:
    from hitchllm.config import EngineConfig

logger = logging.getLogger(__name__)

# Unset: the fused kernel for expert weights on a GPU (4-14x the per-expert loop on an H100 at
# DeepSeek-V2-Lite shapes, benchmarks/moe_kernels.py), the core's PyTorch method elsewhere.
# "triton" forces the kernel (also on the CPU, through Triton's interpreter when
# TRITON_INTERPRET=1), "torch" keeps the PyTorch method.
MOE_KERNEL_ENV = "HITCHLLM_MOE_KERNEL"
MOE_KERNELS = ("triton", "torch")


@hookimpl
def hitchllm_attention_backends() -> list[type[AttentionBackend]]:
    """TRITON_ATTN; importing the backend does not import triton (validate checks for it)."""
    from hitchllm_attention_triton.backend import TritonAttentionBackend

    return [TritonAttentionBackend]


@hookimpl
def hitchllm_model_loaded(model: nn.Module, engine_config: EngineConfig) -> None:
    """Swap the PyTorch method of every unquantized ``FusedMoE`` layer for the fused Triton
    kernel (same weights, nothing to repack): on a GPU unless ``HITCHLLM_MOE_KERNEL=torch``,
    anywhere when it is ``triton``. A quantization plugin's MoE method is left alone."""
    layers = [m for m in model.modules()
              if isinstance(m, FusedMoE) and type(m.moe_method) is UnquantizedMoEMethod]
    on_gpu = any(p.is_cuda for layer in layers for p in layer.parameters())
    if not layers or not _use_triton_moe(on_gpu):
        return
    from hitchllm_attention_triton.moe import TritonMoEMethod

    for layer in layers:
        layer.moe_method = TritonMoEMethod()
        layer.moe_method.process_weights_after_loading(layer)
    logger.info("fused Triton MoE kernel on %d expert layers", len(layers))


def _use_triton_moe(on_gpu: bool) -> bool:
    choice = os.environ.get(MOE_KERNEL_ENV, "").strip().lower()
    if choice and choice not in MOE_KERNELS:
        raise ValueError(f"{MOE_KERNEL_ENV}={choice!r} is not one of {MOE_KERNELS} (unset it "
                         "for the default: the kernel on a GPU, PyTorch elsewhere)")
    has_triton = importlib.util.find_spec("triton") is not None
    if choice == "triton" and not has_triton:
        raise ValueError(f"{MOE_KERNEL_ENV}=triton needs the triton package (pip install "
                         f"triton), or unset {MOE_KERNEL_ENV}")
    return choice == "triton" or (not choice and on_gpu and has_triton)
