"""hitchllm-attention-cpu: the CPU_ATTN paged attention backend for hitchllm on CPUs."""

from hitchllm_attention_cpu.backend import CpuAttentionBackend

__all__ = ["CpuAttentionBackend"]
