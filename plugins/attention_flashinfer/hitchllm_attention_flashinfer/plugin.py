"""Entry point of the plugin: registers FLASHINFER with hitchllm."""

from __future__ import annotations

from hitchllm import hookimpl
from hitchllm.attention import AttentionBackend


@hookimpl
def hitchllm_attention_backends() -> list[type[AttentionBackend]]:
    """FLASHINFER; importing the backend does not import flashinfer (validate checks for it)."""
    from hitchllm_attention_flashinfer.backend import FlashInferAttentionBackend

    return [FlashInferAttentionBackend]
