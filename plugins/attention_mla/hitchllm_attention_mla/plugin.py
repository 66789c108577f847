"""The plugin's hooks: the MLA attention backends and the DeepSeek models."""

from __future__ import annotations

from torch import nn

from hitchllm import hookimpl
from hitchllm.attention import AttentionBackend
from hitchllm_attention_mla.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from hitchllm_attention_mla.flashinfer_mla import FlashInferMLABackend
from hitchllm_attention_mla.torch_mla import TorchMLABackend
from hitchllm_attention_mla.triton_mla import TritonMLABackend


@hookimpl
def hitchllm_attention_backends() -> list[type[AttentionBackend]]:
    """``TRITON_MLA``: the Triton paged decode kernel (NVIDIA GPUs); ``FLASHINFER_MLA``:
    FlashInfer's paged MLA kernel (the ``flashinfer`` extra; importing the backend does not
    import flashinfer, its ``validate`` says when it is missing); ``TORCH_MLA``: the reference
    MLA backend (any device). Auto mode's order is ``ranking.MLA_BACKEND_PRIORITY``."""
    return [TritonMLABackend, FlashInferMLABackend, TorchMLABackend]


@hookimpl
def hitchllm_model_architectures() -> dict[str, type[nn.Module]]:
    """DeepSeek-V2 and V3, with multi-head latent attention."""
    return {"DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
            "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM}
