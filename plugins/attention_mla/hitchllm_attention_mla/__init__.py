"""hitchllm-attention-mla: multi-head latent attention (DeepSeek's MLA) for hitchllm.

- ``MLAAttention`` (``layer``): the attention layer MLA models call; it caches one latent
  vector per token and hands its backend the up-projection ``kv_b_proj``.
- ``TORCH_MLA`` (``torch_mla``): the reference MLA backend, plain PyTorch, runs anywhere.
- ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM`` (``deepseek``): the models.
"""

from hitchllm_attention_mla.layer import MLAAttention, MLAAttentionImpl, MLADims
from hitchllm_attention_mla.torch_mla import TorchMLABackend

__all__ = ["MLAAttention", "MLAAttentionImpl", "MLADims", "TorchMLABackend"]
