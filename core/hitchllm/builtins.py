"""The core's own plugin: the TORCH attention backend and the Llama-family models.

Registered through the same hooks as third-party plugins.
"""

from __future__ import annotations

from torch import nn

from hitchllm.attention.backend import AttentionBackend
from hitchllm.attention.torch_backend import TorchAttentionBackend
from hitchllm.models.llama import LlamaForCausalLM
from hitchllm.plugins import hookimpl


@hookimpl
def hitchllm_attention_backends() -> list[type[AttentionBackend]]:
    return [TorchAttentionBackend]


@hookimpl
def hitchllm_model_architectures() -> dict[str, type[nn.Module]]:
    return {
        "LlamaForCausalLM": LlamaForCausalLM,
        "MistralForCausalLM": LlamaForCausalLM,
        "Qwen2ForCausalLM": LlamaForCausalLM,
        "Qwen3ForCausalLM": LlamaForCausalLM,
    }
