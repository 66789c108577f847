"""hitchllm-attention-mla: multi-head latent attention (DeepSeek's MLA) for hitchllm.

- ``MLAAttention`` / ``MLAAttentionImpl`` (``layer``): the attention layer MLA models call,
  which caches one latent vector per token and hands its impl the up-projection ``kv_b_proj``,
  and the interface every MLA backend's impl implements.
- ``TORCH_MLA`` (``torch_mla``): the reference MLA backend, plain PyTorch, runs anywhere.
- ``TRITON_MLA`` (``triton_mla``): a Triton paged decode kernel (split-KV), TORCH_MLA's prefill.
- ``FLASHINFER_MLA`` (``flashinfer_mla``): FlashInfer's paged MLA kernel for every step
  (the ``flashinfer`` extra).
- ``ranking``: auto mode's order of the MLA backends, one table.
- ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM`` (``deepseek``): the models; their
  mixture-of-experts layers (routers, routed and shared experts) are in ``deepseek_moe``.
"""

from hitchllm_attention_mla.flashinfer_mla import FlashInferMLABackend
from hitchllm_attention_mla.layer import MLAAttention, MLAAttentionImpl, MLADims
from hitchllm_attention_mla.torch_mla import TorchMLABackend
from hitchllm_attention_mla.triton_mla import TritonMLABackend

__all__ = ["FlashInferMLABackend", "MLAAttention", "MLAAttentionImpl", "MLADims",
           "TorchMLABackend", "TritonMLABackend"]
