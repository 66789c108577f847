"""hitchllm-attention-flash: the FLASH_ATTN paged attention backend for hitchllm."""

from hitchllm_attention_flash.backend import FlashAttentionBackend

__all__ = ["FlashAttentionBackend"]
