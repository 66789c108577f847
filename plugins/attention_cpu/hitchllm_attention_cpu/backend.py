"""CPU_ATTN: TORCH's cache layout and prompt path, with a C kernel for decode-like requests.

On a CPU the TORCH backend spends most of a decode step copying every request's context out of
the paged cache (a gather per layer) before its matmuls read it again. Here requests with few
new tokens (decodes, short chunks) go to the C kernel in paged_attention.c, which reads keys and
values where they lie, once. Requests with many new tokens (prompts) keep TORCH's path: gather
their context once and run SDPA, whose blocked matmuls beat any per-token loop there (bf16
prompts with no cached prefix at a length padded to a multiple of 16, which SDPA's bf16 kernel
runs up to 2.5x faster).

An fp8 KV cache (``kv_cache_dtype`` fp8_e4m3 / fp8_e5m2) is written as TORCH writes it (K /
k_scale, clamped); the kernel decodes each byte through a 256-entry float32 table holding the
format's value times the layer's scale (built per step from the scale tensor, so a scale set in
place is seen), and prompts dequantize as they are gathered, as in TORCH.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from hitchllm.attention import (
    FP8_DTYPES,
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionSpec,
    CommonAttentionMetadata,
    TorchAttentionBackend,
    kernel_reasons,
)
from hitchllm.attention.torch_backend import PrefillRequest, TorchAttentionImpl
from hitchllm_attention_cpu.compiler import KernelBuildError, load_fused_ops, load_kernel

#: Requests with more new tokens than this attend through SDPA (blocked matmuls win there).
KERNEL_MAX_QUERY_LEN = 16
#: SDPA's bfloat16 CPU kernel is 1.5-2.5x slower on lengths that are not a multiple
#: of this (a 501-token prompt took 2.5 ms per layer, 496 tokens 1.0 ms): such prompts are
#: padded up to one.
SDPA_LENGTH_MULTIPLE = 16
_DTYPES = (torch.float32, torch.bfloat16)
# The kernel's kv_format argument (see paged_attention.c).
_KV_FORMAT = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 2}


@functools.cache
def _fp8_values(fp8: torch.dtype) -> torch.Tensor:
    """Every byte of the ``fp8`` format as float32 (index = the byte)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8).float()


def fp8_decode_table(fp8: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """Every byte of the ``fp8`` format as float32, times ``scale``: what the kernel reads
    for a stored byte, and exactly TORCH's ``dequantize_kv`` in float32."""
    return _fp8_values(fp8) if scale is None else _fp8_values(fp8) * scale.float()


@dataclass
class KernelRequests:
    """The requests the C kernel attends, as the host arrays it reads (see paged_attention.c)."""

    query_start: torch.Tensor  # [n] int64
    query_len: torch.Tensor  # [n] int64
    context_len: torch.Tensor  # [n] int64: tokens cached before this step
    block_table: torch.Tensor  # [n, cols] int32, each row contiguous (any row stride)


@dataclass
class CpuAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    kernel: KernelRequests | None
    prompts: list[PrefillRequest]  # attended one by one through SDPA


class CpuAttentionMetadataBuilder(AttentionMetadataBuilder):
    """Splits the step's requests between the kernel and SDPA, on the host (the device)."""

    def build(self, common: CommonAttentionMetadata) -> CpuAttentionMetadata:
        n = common.num_reqs
        starts = common.query_start_loc_cpu[: n + 1].long()
        query_lens = starts[1:] - starts[:-1]
        context_lens = common.num_computed_tokens_cpu[:n].long()
        # The kernel applies the soft-cap; SDPA cannot, so with one every request goes there.
        to_sdpa = query_lens > KERNEL_MAX_QUERY_LEN
        if self.spec.logits_soft_cap is not None:
            to_sdpa.zero_()
        block_size = self.spec.block_size
        cols = min(-(-common.max_seq_len // block_size), common.block_table.shape[1])
        table = common.block_table[:n, :cols]
        if table.stride(1) != 1:  # the kernel takes any row stride, but unit column stride
            table = table.contiguous()
        if bool(to_sdpa.any()):
            rows = torch.nonzero(~to_sdpa).flatten()
            prompts = [PrefillRequest(i, int(starts[i]), int(query_lens[i]), int(context_lens[i]))
                       for i in torch.nonzero(to_sdpa).flatten().tolist()]
            kernel = None
            if len(rows):
                kernel = KernelRequests(starts[rows], query_lens[rows], context_lens[rows],
                                        table[rows].contiguous())
        else:
            prompts = []
            kernel = KernelRequests(starts[:n], query_lens, context_lens, table)
        return CpuAttentionMetadata(
            slot_mapping=common.slot_mapping[: common.num_actual_tokens],
            block_table=common.block_table[:n],
            kernel=kernel,
            prompts=prompts,
        )


class CpuAttentionImpl(TorchAttentionImpl):
    """Writes the cache and attends prompts as TORCH does; decodes go to the C kernel."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: CpuAttentionMetadata,
    ) -> torch.Tensor:
        self.write_kv_cache(kv_cache, key, value, metadata.slot_mapping)
        key_cache, value_cache = kv_cache.unbind(0)
        # The kernel reads and writes float32 rows; a bfloat16 model converts at the edges.
        # A step of prompts only (no kernel requests) writes SDPA's output in the model dtype
        # directly (two passes fewer over [tokens, heads, d] in bfloat16).
        dtype = torch.float32 if metadata.kernel is not None else query.dtype
        out = torch.zeros(query.shape, dtype=dtype)
        if metadata.kernel is not None:
            self._attend_in_place(query, key_cache, value_cache, metadata.kernel, out)
        self.attend_prefills(query, key_cache, value_cache, metadata.block_table,
                             metadata.prompts, out)
        return out.to(query.dtype)

    def write_kv_cache(
        self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """TORCH's cache write (same layout, same values) as one C copy of each row to its
        slot (fused_ops.c's ``hitch_write_kv``) where the cache holds the model dtype: TORCH's
        takes six operators per layer (the padding slots redirected, two transposes, two
        ``index_copy_``). fp8 caches (quantized on the way) keep TORCH's."""
        n = len(slot_mapping)
        if (kv_cache.dtype != key.dtype or not kv_cache.is_contiguous() or key.dim() != 3
                or not _heads_contiguous(key) or not _heads_contiguous(value)
                or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous()
                or key.shape[0] < n or value.shape[0] < n):
            super().write_kv_cache(kv_cache, key, value, slot_mapping)
            return
        key_cache, value_cache = kv_cache.unbind(0)
        cache_slots = key_cache.shape[1] * key_cache.shape[2]
        status = load_fused_ops().functions["hitch_write_kv"](
            key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
            key_cache.data_ptr(), value_cache.data_ptr(), slot_mapping.data_ptr(), n,
            self.num_kv_heads, self.head_size, cache_slots, key.element_size())
        if status != 0:
            raise IndexError(f"CPU_ATTN: a slot in the slot mapping is outside the KV cache "
                             f"({cache_slots} slots)")

    def attend_request(
        self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        block_table: torch.Tensor, context_len: int,
    ) -> torch.Tensor:
        """TORCH's prompt path, except that a bfloat16 prompt with no cached prefix
        (plain causal attention) runs at a length padded to ``SDPA_LENGTH_MULTIPLE``: the
        padding's keys come after every real query, so the causal mask hides them; its
        queries' rows are dropped."""
        q_len = q.shape[0]
        padded = -(-q_len // SDPA_LENGTH_MULTIPLE) * SDPA_LENGTH_MULTIPLE
        window = self.spec.sliding_window
        if (context_len or padded == q_len or q.dtype != torch.bfloat16
                or (window is not None and window < q_len)):
            return super().attend_request(q, key_cache, value_cache, block_table, context_len)
        cols = -(-q_len // key_cache.shape[2])
        k = self._padded_context(key_cache, block_table[:cols], q_len, padded, q.dtype,
                                 self.k_scale)
        v = self._padded_context(value_cache, block_table[:cols], q_len, padded, q.dtype,
                                 self.v_scale)
        qp = q.new_zeros(1, self.num_heads, padded, self.head_size)
        qp[0, :, :q_len] = q.transpose(0, 1)
        out = F.scaled_dot_product_attention(qp, k, v, is_causal=True, scale=self.scale,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return out[0, :, :q_len].transpose(0, 1)

    def _padded_context(
        self, cache: torch.Tensor, block_table: torch.Tensor, length: int, padded: int,
        dtype: torch.dtype, scale: torch.Tensor | None,
    ) -> torch.Tensor:
        """The first ``length`` cached rows of a request ([1, kv_heads, padded, d]), then
        zeros up to ``padded`` (never stale cache rows: a masked key's value still meets a
        zero weight, and 0 * inf is NaN)."""
        context = self._gather(cache, block_table, length, dtype, scale)
        rows = context.new_zeros(self.num_kv_heads, padded, self.head_size)
        rows[:, :length] = context
        return rows[None]

    def _attend_in_place(
        self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        k: KernelRequests, out: torch.Tensor,
    ) -> None:
        if not key_cache.is_contiguous() or key_cache.dtype not in _KV_FORMAT:
            raise ValueError(f"CPU_ATTN reads a contiguous float32, bfloat16 or fp8 cache shaped "
                             f"as get_kv_cache_shape says, not {key_cache.dtype} with strides "
                             f"{key_cache.stride()}")
        k_table = v_table = None
        if key_cache.dtype in FP8_DTYPES:
            k_table = fp8_decode_table(key_cache.dtype, self.k_scale)
            v_table = fp8_decode_table(key_cache.dtype, self.v_scale)
        q = query.to(torch.float32).contiguous()
        softcap = self.spec.logits_soft_cap or 0.0
        window = self.spec.sliding_window or 0
        status = load_kernel().function(
            q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), out.data_ptr(),
            k.query_start.data_ptr(), k.query_len.data_ptr(), k.context_len.data_ptr(),
            k.block_table.data_ptr(), k.block_table.stride(0), k.query_len.shape[0],
            self.num_heads, self.num_kv_heads, self.head_size, key_cache.shape[2],
            key_cache.shape[1], self.scale, softcap, window,
            _KV_FORMAT[key_cache.dtype], _pointer(k_table), _pointer(v_table),
            torch.get_num_threads())
        if status != 0:
            raise MemoryError("CPU_ATTN: a kernel thread could not allocate its scratch buffer")


def _heads_contiguous(x: torch.Tensor) -> bool:
    """[tokens, heads, d] with each token's heads contiguous (any token stride)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class CpuAttentionBackend(AttentionBackend):
    """Paged attention for CPUs: a C kernel (built on first use) for decodes, SDPA for prompts.
    Shares TORCH's head-major KV-cache layout."""

    name: ClassVar[str] = "CPU_ATTN"
    priority: ClassVar[int] = 50

    @classmethod
    def validate(cls, spec: AttentionSpec) -> list[str]:
        reasons = []
        if spec.device_type != "cpu":
            reasons.append(f"runs on the CPU only, not {spec.device_type} (on CUDA use "
                           "TRITON_ATTN, FLASHINFER or FLASH_ATTN)")
        # fp8 caches are decoded by the kernel: check the rest as for a cache in the model dtype.
        if spec.kv_cache_dtype in FP8_DTYPES:
            spec = dataclasses.replace(spec, kv_cache_dtype=spec.dtype)
        reasons += kernel_reasons(spec, dtypes=_DTYPES)
        if not reasons:  # building the kernel is the slow check: only when it would be used
            try:
                load_kernel()
            except KernelBuildError as err:
                reasons.append(f"the C kernel is unavailable: {err}")
        return reasons

    @classmethod
    def get_kv_cache_shape(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return TorchAttentionBackend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads,
                                                        head_size)

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        return CpuAttentionImpl

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        return CpuAttentionMetadataBuilder
