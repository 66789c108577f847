"""The plugin's hook implementations (entry point ``hitchllm.plugins: quantization``)."""

from __future__ import annotations

from hitchllm import hookimpl
from hitchllm_quantization.awq import AWQ


@hookimpl
def hitchllm_quantization_methods() -> dict[str, type]:
    """The weight quantization methods: name (as in ``quantization=`` or a checkpoint's
    ``quantization_config.quant_method``) -> class."""
    return {"awq": AWQ}
