"""A whole Llama-family decoder layer of a bfloat16 decode step as one straight run of the
plugin's C calls.

Through the modules, a decode step of the bundled model (8 layers, 32 rows) spends more time
in Python than in its kernels: each layer makes about 20 module calls, and each of its ten C
kernels sits behind a chain of checks (``UnquantizedLinearMethod``, ``fused``'s dispatch, the
kernel's own), several output allocations and a ctypes call. ``DecodeLayerKernel`` runs the
same kernels with the same inputs in the same order (RMSNorm, the AMX q/k/v projection,
rotary, the KV write, CPU_ATTN's kernel, the AMX o projection, add + RMSNorm, gate/up, SiLU-and-mul,
down), so its result equals the modules' bit for bit; what it leaves out is the Python between
them: the layer's structure is checked once, at ``install``, and a call checks only what can
change from step to step.

It takes decode steps only (every request through CPU_ATTN's kernel, 1-``amx_linear.MAX_ROWS``
rows, a bfloat16 KV cache); anything else (prompts, fp8 caches, more rows, a layer whose
linears were reloaded or given another linear method, LoRA) returns None, and the layer runs
its modules. Attached by ``install`` as ``layer.__dict__[LAYER_KERNEL]``, which
``PreNormDecoderLayer.forward`` tries first.
"""

from __future__ import annotations

import torch
from torch import nn

from hitchllm.attention.forward_context import get_forward_context
from hitchllm.layers import CPU_BF16_KERNEL, UnquantizedLinearMethod
from hitchllm.models.llama import LAYER_KERNEL, LlamaAttention, LlamaDecoderLayer, LlamaMLP
from hitchllm_attention_cpu.amx_linear import MAX_ROWS, AmxKernel
from hitchllm_attention_cpu.backend import CpuAttentionImpl, CpuAttentionMetadata
from hitchllm_attention_cpu.compiler import load_fused_ops, load_kernel

_BF16 = 1  # fused_ops.c's dtype code
_KV_BF16 = 1  # paged_attention.c's kv_format


class DecodeLayerKernel:
    """``layer(positions, hidden, residual)`` for a decode step, or None (see the module's
    docstring). Holds the layer's AMX kernels and norm weights; the KV cache, the attention
    backend and the step's metadata are read per call."""

    def __init__(self, layer: LlamaDecoderLayer) -> None:
        attention: LlamaAttention = layer.self_attn  # type: ignore[assignment]
        mlp: LlamaMLP = layer.mlp  # type: ignore[assignment]
        self.layer = layer
        self.attention = attention
        self.linears = tuple((module, module.__dict__[CPU_BF16_KERNEL]) for module in (
            attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj))
        (_, self.qkv), (_, self.o_proj), (_, self.gate_up), (_, self.down) = self.linears
        self.heads, self.kv_heads = attention.num_heads, attention.num_kv_heads
        self.head_size = attention.head_dim
        self.q_size, self.kv_size = attention.q_size, attention.kv_size
        self.qk_norm = (attention.q_norm, attention.k_norm) if attention.qk_norm else None
        self.fused = load_fused_ops().functions
        self.paged_attention = load_kernel().function

    def __call__(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        rows = hidden.shape[0]
        attn = self.attention.attn
        impl, kv_cache = attn.impl, attn.kv_cache
        context = get_forward_context()
        metadata = context.attn_metadata
        if (hidden.dtype != torch.bfloat16 or hidden.dim() != 2 or not 1 <= rows <= MAX_ROWS
                or not hidden.is_contiguous() or torch.is_grad_enabled()
                or (residual is not None and not residual.is_contiguous())
                or not isinstance(impl, CpuAttentionImpl) or kv_cache is None
                or kv_cache.dtype != torch.bfloat16 or not kv_cache.is_contiguous()
                or context.split_attention is not None
                or not isinstance(metadata, CpuAttentionMetadata) or metadata.prompts
                or metadata.kernel is None or len(metadata.slot_mapping) != rows
                or not metadata.slot_mapping.is_contiguous()
                or positions.shape != (rows,) or positions.dtype != torch.int64
                or not positions.is_contiguous()
                or any(module.__dict__.get(CPU_BF16_KERNEL) is not kernel
                       or type(module.linear_method) is not UnquantizedLinearMethod
                       for module, kernel in self.linears)):
            return None
        threads = torch.get_num_threads()
        layer = self.layer
        normed, total = self._norm(layer.input_layernorm, hidden, residual, threads)
        qkv = self.qkv(normed)
        attended = self._attend(positions, qkv, impl, kv_cache, metadata, threads)
        normed, total = self._norm(layer.post_attention_layernorm, self.o_proj(attended), total,
                                   threads)
        gate_up = self.gate_up(normed)
        width = gate_up.shape[1] // 2
        activated = torch.empty(rows, width, dtype=torch.bfloat16)
        self.fused["hitch_silu_and_mul"](gate_up.data_ptr(), gate_up.shape[1],
                                         activated.data_ptr(), rows, width, _BF16, threads)
        return self.down(activated), total

    def _norm(
        self, norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, threads: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(x + residual), x + residual)``, or ``(rms_norm(x), x)`` without a
        residual (the first layer)."""
        out = torch.empty_like(x)
        total = x if residual is None else torch.empty_like(x)
        self.fused["hitch_rms_norm"](
            x.data_ptr(), x.shape[1], None if residual is None else residual.data_ptr(),
            x.shape[1], None if residual is None else total.data_ptr(), norm.weight.data_ptr(),
            out.data_ptr(), x.shape[0], x.shape[1], norm.eps, _BF16, threads)
        return out, total

    def _attend(
        self, positions: torch.Tensor, qkv: torch.Tensor, impl: CpuAttentionImpl,
        kv_cache: torch.Tensor, metadata: CpuAttentionMetadata, threads: int,
    ) -> torch.Tensor:
        """Rotary on q and k, k and v into the cache, attention: [rows, heads * d] bf16."""
        rows, d, stride = qkv.shape[0], self.head_size, qkv.shape[1]
        q = torch.empty(rows, self.heads, d, dtype=torch.bfloat16)
        k = torch.empty(rows, self.kv_heads, d, dtype=torch.bfloat16)
        rotary = self.attention.rotary
        weights, eps = (None, None), 0.0
        if self.qk_norm is not None:
            weights = (self.qk_norm[0].weight.data_ptr(), self.qk_norm[1].weight.data_ptr())
            eps = self.qk_norm[0].eps
        base = qkv.data_ptr()
        status = self.fused["hitch_rotary"](
            positions.data_ptr(), base, stride, self.heads, q.data_ptr(),
            base + 2 * self.q_size, stride, self.kv_heads, k.data_ptr(), rows, d,
            rotary.cos.data_ptr(), rotary.sin.data_ptr(), rotary.cos.shape[0], *weights, eps,
            _BF16, threads)
        if status != 0:
            return self._position_error(positions, rotary.cos.shape[0])
        key_cache, value_cache = kv_cache.unbind(0)
        cache_slots = key_cache.shape[1] * key_cache.shape[2]
        if self.fused["hitch_write_kv"](
                k.data_ptr(), self.kv_size, base + 2 * (self.q_size + self.kv_size), stride,
                key_cache.data_ptr(), value_cache.data_ptr(), metadata.slot_mapping.data_ptr(),
                rows, self.kv_heads, d, cache_slots, 2) != 0:
            raise IndexError(f"CPU_ATTN: a slot in the slot mapping is outside the KV cache "
                             f"({cache_slots} slots)")
        query = q.float()
        out = torch.zeros(rows, self.heads, d)
        requests = metadata.kernel
        assert requests is not None  # checked by the caller
        if self.paged_attention(
                query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), out.data_ptr(),
                requests.query_start.data_ptr(), requests.query_len.data_ptr(),
                requests.context_len.data_ptr(), requests.block_table.data_ptr(),
                requests.block_table.stride(0), requests.query_len.shape[0], self.heads,
                self.kv_heads, d, key_cache.shape[2], key_cache.shape[1], impl.scale,
                impl.spec.logits_soft_cap or 0.0, impl.spec.sliding_window or 0, _KV_BF16,
                None, None, threads) != 0:
            raise MemoryError("CPU_ATTN: a kernel thread could not allocate its scratch buffer")
        return out.to(torch.bfloat16).view(rows, self.heads * d)

    @staticmethod
    def _position_error(positions: torch.Tensor, table: int) -> torch.Tensor:
        bad = positions[(positions < 0) | (positions >= table)]
        raise IndexError(f"rotary: position {int(bad[0])} is outside the rotary tables "
                         f"(max_position_embeddings {table}); keep prompts and max_model_len "
                         "within the model's context length")


def takes(layer: nn.Module) -> bool:
    """Whether ``layer`` is a dense Llama-family layer whose four linears run on the AMX
    kernel, with no biases and bfloat16 norms."""
    if type(layer) is not LlamaDecoderLayer or type(layer.mlp) is not LlamaMLP \
            or type(layer.self_attn) is not LlamaAttention:
        return False
    attention, mlp = layer.self_attn, layer.mlp
    linears = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if attention.qk_norm:
        norms += [attention.q_norm, attention.k_norm]
    return (all(isinstance(m.__dict__.get(CPU_BF16_KERNEL), AmxKernel) and m.bias is None
                for m in linears)
            and all(n.weight.dtype == torch.bfloat16 and n.weight.is_contiguous() for n in norms))


def install(model: nn.Module) -> int:
    """Attach a ``DecodeLayerKernel`` to every layer of ``model`` it takes (after
    ``amx_linear.install``); returns how many layers."""
    count = 0
    for module in model.modules():
        if takes(module):
            module.__dict__[LAYER_KERNEL] = DecodeLayerKernel(module)  # type: ignore[arg-type]
            count += 1
    return count
