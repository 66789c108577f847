"""hitchllm-attention-triton: the TRITON_ATTN paged attention backend for hitchllm."""

from hitchllm_attention_triton.backend import TritonAttentionBackend

__all__ = ["TritonAttentionBackend"]
