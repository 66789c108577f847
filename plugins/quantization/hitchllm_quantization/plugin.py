"""The plugin's hook implementations (entry point ``hitchllm.plugins: quantization``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hitchllm import hookimpl
from hitchllm_quantization.awq import AWQ
from hitchllm_quantization.compressed_tensors import CompressedTensors
from hitchllm_quantization.fp8 import Fp8

if TYPE_CHECKING:
    import torch
    from torch import nn

    from hitchllm.config import EngineConfig, ModelConfig


@hookimpl
def hitchllm_quantization_methods() -> dict[str, type]:
    """The weight quantization methods: name (as in ``quantization=`` or a checkpoint's
    ``quantization_config.quant_method``) -> class."""
    return {
        "awq": AWQ,
        "fp8": Fp8,
        "compressed-tensors": CompressedTensors,
    }


@hookimpl
def hitchllm_kv_cache_scales(
    model: nn.Module, model_config: ModelConfig, engine_config: EngineConfig,
    kv_cache_dtype: torch.dtype,
) -> None:
    """fp8 KV cache: check the checkpoint's scales, or arrange to compute them from the first
    prompts served (``calculate_kv_scales``); see ``hitchllm_quantization.fp8_kv``."""
    from hitchllm_quantization import fp8_kv

    calibration = fp8_kv.settle_kv_scales(model, model_config.hf_config, kv_cache_dtype,
                                          engine_config.calculate_kv_scales)
    if calibration is not None:
        fp8_kv.wait_for_first_step(model, calibration)


@hookimpl
def hitchllm_before_forward(model: nn.Module) -> None:
    """Arms a waiting KV-scale calibration at its model's first step that serves prompts."""
    from hitchllm_quantization import fp8_kv

    fp8_kv.first_step_begins(model)
