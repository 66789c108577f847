"""The core's own plugin: the TORCH attention backend, the Llama-family models (dense and
mixture-of-experts) and the logits processors behind ``logit_bias``, ``allowed_token_ids``
and ``bad_words``.

Registered through the same hooks as third-party plugins.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hitchllm.attention.backend import AttentionBackend
from hitchllm.attention.torch_backend import TorchAttentionBackend
from hitchllm.engine.logits_processors import AllowedTokenIds, BadWords, LogitBias
from hitchllm.hookspecs import hookimpl
from hitchllm.logits_processor import LogitsProcessor
from hitchllm.models.llama import LlamaForCausalLM
from hitchllm.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM


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
        "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
        "MixtralForCausalLM": MixtralForCausalLM,
    }


@hookimpl
def hitchllm_logits_processors(tokenizer: Any) -> list[LogitsProcessor]:
    return [LogitBias(), AllowedTokenIds(), BadWords(tokenizer)]
