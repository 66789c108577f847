"""The plugin's hook implementations (entry point ``hitchllm.plugins: quantization``)."""

from __future__ import annotations

from hitchllm import hookimpl
from hitchllm_quantization.compressed_tensors import CompressedTensors
from hitchllm_quantization.fp8 import Fp8


@hookimpl
def hitchllm_quantization_methods() -> dict[str, type]:
    """The weight quantization methods: name (as in ``quantization=`` or a checkpoint's
    ``quantization_config.quant_method``) -> class."""
    return {
        "fp8": Fp8,
        "compressed-tensors": CompressedTensors,
    }
