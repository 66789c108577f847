"""hitchllm-attention-flashinfer: the FLASHINFER paged attention backend for hitchllm."""

from hitchllm_attention_flashinfer.backend import FlashInferAttentionBackend

__all__ = ["FlashInferAttentionBackend"]
