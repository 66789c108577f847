"""Entry point of the plugin: registers CPU_ATTN with hitchllm."""

from __future__ import annotations

from hitchllm import hookimpl
from hitchllm.attention import AttentionBackend


@hookimpl
def hitchllm_attention_backends() -> list[type[AttentionBackend]]:
    """CPU_ATTN; importing the backend compiles nothing (validate builds the kernel)."""
    from hitchllm_attention_cpu.backend import CpuAttentionBackend

    return [CpuAttentionBackend]
