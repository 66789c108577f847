"""Entry point of the plugin: registers TRITON_ATTN with hitchllm."""

from __future__ import annotations

from hitchllm import hookimpl
from hitchllm.attention import AttentionBackend


@hookimpl
def hitchllm_attention_backends() -> list[type[AttentionBackend]]:
    """TRITON_ATTN; importing the backend does not import triton (validate checks for it)."""
    from hitchllm_attention_triton.backend import TritonAttentionBackend

    return [TritonAttentionBackend]
