"""Entry point of the plugin: registers FLASH_ATTN with hitchllm."""

from __future__ import annotations

from hitchllm import hookimpl
from hitchllm.attention import AttentionBackend


@hookimpl
def hitchllm_attention_backends() -> list[type[AttentionBackend]]:
    """FLASH_ATTN; importing the backend does not import flash_attn (validate checks for it)."""
    from hitchllm_attention_flash.backend import FlashAttentionBackend

    return [FlashAttentionBackend]
