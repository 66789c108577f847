"""FLASH_ATTN: FlashAttention's variable-length kernels reading the paged cache in place.

Two generations of the library serve it; the backend picks one per device:

- FlashAttention-4 (package ``flash-attn-4``, module ``flash_attn.cute``, Hopper and
  Blackwell): ``flash_attn_varlen_func`` with ``page_table`` (the block table) and
  ``seqused_k`` (each request's context length). Any block size.
- FlashAttention-2 (package ``flash-attn``, Ampere and newer): ``flash_attn_varlen_func`` with
  ``block_table`` and cumulative context lengths; its paged path needs block sizes that are
  multiples of 256.

Both take the step's tensors as they are (query start locations, context lengths, block
table), so the builder does no host work and decode batches run under CUDA graphs.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from typing import ClassVar

import torch

from hitchllm.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionSpec,
    CommonAttentionMetadata,
    CudaGraphSupport,
    kernel_reasons,
    nhd_cache_shape,
    pad_rows,
    write_nhd,
)

FA2_BLOCK_MULTIPLE = 256
INSTALL_HINT = ("pip install 'hitchllm-attention-flash[kernels]' for FlashAttention-4 "
                "(Hopper/Blackwell), or pip install flash-attn for FlashAttention-2")


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def fa4_installed() -> bool:
    """FlashAttention-4: the ``flash-attn-4`` distribution providing ``flash_attn.cute``."""
    return _installed("flash-attn-4")


def fa2_installed() -> bool:
    """FlashAttention-2: the ``flash-attn`` distribution (2.x) providing ``flash_attn``."""
    if not _installed("flash-attn"):
        return False
    return importlib.metadata.version("flash-attn").startswith("2.")


def _fa4_runs_on(capability: tuple[int, int] | None) -> bool:
    return capability is not None and capability[0] in (9, 10, 11)


def choose_version(spec: AttentionSpec) -> int | None:
    """4 or 2: the FlashAttention generation that serves ``spec`` (None: neither)."""
    if fa4_installed() and _fa4_runs_on(spec.device_capability):
        return 4
    if fa2_installed():
        return 2
    return None


@dataclass
class FlashAttentionMetadata:
    """The step's device tensors as FlashAttention takes them."""

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor  # [n + 1] int32
    seq_lens: torch.Tensor  # [n] int32: context length after this step
    cu_seq_lens: torch.Tensor | None  # [n + 1] int32, FlashAttention-2 only
    block_table: torch.Tensor  # [n, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    num_tokens: int


class FlashAttentionMetadataBuilder(AttentionMetadataBuilder):
    """Hands the engine's tensors through; FlashAttention-2 also needs cumulative context
    lengths, computed on the device: for CUDA-graph batches into one buffer that the graphs
    captured (sized by the first, largest, graph batch and never replaced), for other batches
    into a fresh tensor."""

    def __init__(self, spec: AttentionSpec, device: torch.device) -> None:
        super().__init__(spec, device)
        self.version = choose_version(spec)
        self._graph_cu_seq_lens: torch.Tensor | None = None

    def build(self, common: CommonAttentionMetadata) -> FlashAttentionMetadata:
        n = common.num_reqs
        seq_lens = common.seq_lens[:n]
        cu = None
        if self.version == 2:
            cu = self._cu_buffer(n, common.cuda_graph)
            torch.cumsum(seq_lens, 0, dtype=torch.int32, out=cu[1:])
        return FlashAttentionMetadata(
            slot_mapping=common.slot_mapping[: common.num_actual_tokens],
            query_start_loc=common.query_start_loc[: n + 1],
            seq_lens=seq_lens,
            cu_seq_lens=cu,
            block_table=common.block_table[:n],
            max_query_len=common.max_query_len,
            max_seq_len=max(1, common.max_seq_len),
            num_tokens=common.num_actual_tokens,
        )


    def _cu_buffer(self, n: int, cuda_graph: bool) -> torch.Tensor:
        if not cuda_graph:
            return torch.zeros(n + 1, dtype=torch.int32, device=self.device)
        if self._graph_cu_seq_lens is None:  # the engine captures its largest size first
            self._graph_cu_seq_lens = torch.zeros(n + 1, dtype=torch.int32, device=self.device)
        if self._graph_cu_seq_lens.numel() < n + 1:
            raise RuntimeError(f"a CUDA-graph batch of {n} requests came after smaller ones: "
                               "capture the largest graph size first")
        return self._graph_cu_seq_lens[: n + 1]


class FlashAttentionImpl(AttentionImpl):
    """Writes K/V into the pages, then runs FlashAttention-4 or -2 over them."""

    def __init__(
        self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, spec: AttentionSpec
    ) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, spec)
        self.version = choose_version(spec)
        window = spec.sliding_window
        self.window = (window - 1, 0) if window else None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: FlashAttentionMetadata,
    ) -> torch.Tensor:
        n = metadata.num_tokens
        write_nhd(kv_cache, key, value, metadata.slot_mapping)
        if n == 0:
            return torch.zeros_like(query)
        run = self._fa4 if self.version == 4 else self._fa2
        return pad_rows(run(query[:n], kv_cache, metadata), query.shape[0])

    def _fa4(self, q: torch.Tensor, kv_cache: torch.Tensor,
             m: FlashAttentionMetadata) -> torch.Tensor:
        from flash_attn.cute import flash_attn_varlen_func

        window = self.window or (None, None)
        out, _ = flash_attn_varlen_func(
            q, kv_cache[0], kv_cache[1],
            cu_seqlens_q=m.query_start_loc, seqused_k=m.seq_lens, page_table=m.block_table,
            max_seqlen_q=m.max_query_len, max_seqlen_k=m.max_seq_len,
            softmax_scale=self.scale, causal=True, window_size=window,
            softcap=self.spec.logits_soft_cap or 0.0,
        )
        return out

    def _fa2(self, q: torch.Tensor, kv_cache: torch.Tensor,
             m: FlashAttentionMetadata) -> torch.Tensor:
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(
            q, kv_cache[0], kv_cache[1],
            cu_seqlens_q=m.query_start_loc, cu_seqlens_k=m.cu_seq_lens,
            max_seqlen_q=m.max_query_len, max_seqlen_k=m.max_seq_len,
            softmax_scale=self.scale, causal=True, window_size=self.window or (-1, -1),
            softcap=self.spec.logits_soft_cap or 0.0, block_table=m.block_table,
        )


class FlashAttentionBackend(AttentionBackend):
    """FlashAttention-4 or -2 over the paged cache: prefill, chunked prefill, decode and mixed
    batches, GQA/MQA, sliding window, logits soft-cap, CUDA graphs for decode batches."""

    name: ClassVar[str] = "FLASH_ATTN"
    priority: ClassVar[int] = 80
    cuda_graph_support: ClassVar[CudaGraphSupport] = CudaGraphSupport.UNIFORM_DECODE

    @classmethod
    def validate(cls, spec: AttentionSpec) -> list[str]:
        has4, has2 = fa4_installed(), fa2_installed()
        if not (has4 or has2):
            return [f"flash-attn is not installed ({INSTALL_HINT})"]
        if spec.device_type != "cuda":
            return [f"no CUDA device (FlashAttention runs on NVIDIA GPUs; device is "
                    f"{spec.device_type!r})"]
        reasons = []
        cap = spec.device_capability
        version = choose_version(spec)
        if version is None:  # only FlashAttention-4, on a card it does not run on
            shown = f"{cap[0]}.{cap[1]}" if cap else "unknown"
            reasons.append(f"FlashAttention-4 runs on Hopper and Blackwell (compute capability "
                           f"9.0 or 10.x), this card is {shown}; install flash-attn "
                           "(FlashAttention-2) for Ampere")
        elif version == 2:
            if cap is not None and cap < (8, 0):
                reasons.append(f"compute capability {cap[0]}.{cap[1]} is below 8.0 "
                               "(FlashAttention-2 needs Ampere or newer)")
            if spec.block_size % FA2_BLOCK_MULTIPLE:
                reasons.append(
                    f"FlashAttention-2's paged KV needs a block size that is a multiple of "
                    f"{FA2_BLOCK_MULTIPLE} (block_size is {spec.block_size}: pass "
                    f"block_size={FA2_BLOCK_MULTIPLE} / --block-size {FA2_BLOCK_MULTIPLE}, or "
                    "install flash-attn-4 on Hopper/Blackwell, which takes any block size)")
        reasons += kernel_reasons(spec)
        if spec.head_size % 8 or not 8 <= spec.head_size <= 256:
            reasons.append(f"head size {spec.head_size} is not supported (a multiple of 8 "
                           "from 8 to 256)")
        elif version == 4 and cap is not None and cap[0] in (10, 11) and \
                128 < spec.head_size < 256:
            reasons.append(f"head size {spec.head_size} is not supported by FlashAttention-4 "
                           "on Blackwell (up to 128, or 256)")
        return reasons

    @classmethod
    def get_kv_cache_shape(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return nhd_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        return FlashAttentionImpl

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        return FlashAttentionMetadataBuilder
