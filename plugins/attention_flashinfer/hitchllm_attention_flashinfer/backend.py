"""FLASHINFER: FlashInfer's paged-KV batch prefill and batch decode kernels.

FlashInfer splits work into a host-side ``plan`` (which pages each request reads, how the
work is cut across thread blocks) and a device-side ``run``. The metadata builder plans once
per engine step on the wrapper that fits the batch; every layer then runs on it:

- decode steps (one new token per request) use ``BatchDecodeWithPagedKVCacheWrapper``; CUDA
  graph batches use one such wrapper per captured batch size, built with ``use_cuda_graph``
  so its page lists live in buffers the graph captured, and re-planned before each replay;
- any other step (prompts, prompt chunks over a cached prefix, mixed batches) uses
  ``BatchPrefillWithPagedKVCacheWrapper`` with a bottom-right causal mask.

An fp8 KV cache (e4m3 or e5m2) is planned with ``kv_data_type`` fp8: FlashInfer's kernels read
the fp8 pages and convert them in registers. The layer's scales are device tensors, while
FlashInfer's ``run(k_scale=, v_scale=)`` takes host floats (folded into the softmax scale at
call time, which would need a host read each step and freeze the value into a CUDA graph), so
the impl applies them itself on the device: ``k_scale`` multiplies the query and ``v_scale``
the output (exact up to one rounding of q, since scores and output are linear in K and V).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from hitchllm.attention import (
    FP8_DTYPES,
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionSpec,
    CommonAttentionMetadata,
    CudaGraphSupport,
    kernel_reasons,
    nhd_cache_shape,
    pad_rows,
    quantize_kv,
    write_nhd,
)

#: Head sizes FlashInfer's kernels are built for.
HEAD_SIZES = (64, 128, 256)
#: Float workspace shared by the wrappers (split-KV partial results); FlashInfer suggests 128 MB.
WORKSPACE_BYTES = 128 * 1024 * 1024
#: FlashInfer's int workspace (plan data), the size its wrappers allocate for themselves.
INT_WORKSPACE_BYTES = 8 * 1024 * 1024
INSTALL_HINT = "pip install 'hitchllm-attention-flashinfer[kernels]' (or flashinfer-python)"


def _flashinfer_installed() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


@dataclass
class FlashInferMetadata:
    """The step's slot mapping and the wrapper planned for it (None: no tokens)."""

    slot_mapping: torch.Tensor
    wrapper: Any
    num_tokens: int


def page_lists(
    table: np.ndarray, seq_lens: np.ndarray, block_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FlashInfer's page lists (``indptr`` [n + 1], ``indices``, ``last_page_len`` [n], int32)
    for requests with context lengths ``seq_lens`` [n] and block table ``table`` [m, cols]
    (m <= n rows: the real requests). Requests beyond ``m`` are padding of a CUDA-graph batch
    (context 0): they read one entry of block 0, so every request is well formed; their
    outputs are discarded."""
    n, real = len(seq_lens), table.shape[0]
    seq = seq_lens.astype(np.int64)
    counts = np.ones(n, dtype=np.int64)
    counts[:real] = -(-seq[:real] // block_size)
    indptr = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(counts, out=indptr[1:])
    last = np.ones(n, dtype=np.int32)
    last[:real] = seq[:real] - (counts[:real] - 1) * block_size
    used = np.arange(table.shape[1])[None, :] < counts[:real, None]
    indices = np.zeros(int(indptr[-1]), dtype=np.int32)
    real_pages = table[used]
    indices[: len(real_pages)] = real_pages
    return indptr, indices, last


@dataclass
class PageLists:
    """FlashInfer's description of the step: ``indptr`` [n + 1], ``last_page_len`` [n] and
    ``qo_indptr`` [n + 1] (query start locations) in pinned host memory, ``indices``
    [indptr[-1]] on the device. The host tensors are copied to the device asynchronously by
    the plan, so they live in the builder's staging buffer, which the builder's event guards
    (the engine's own host buffers are refilled for the next step without waiting for them)."""

    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor
    qo_indptr: torch.Tensor


class FlashInferMetadataBuilder(AttentionMetadataBuilder):
    """Owns the wrappers and plans the step's wrapper on the host.

    Planning writes into pinned host buffers that are copied to the device asynchronously.
    With async scheduling the next step is planned while this one may still be queued, so
    before writing those buffers again the builder waits for an event recorded after the
    previous plan's copies (normally long passed: it is only a guard).
    """

    def __init__(self, spec: AttentionSpec, device: torch.device) -> None:
        super().__init__(spec, device)
        import flashinfer

        self._flashinfer = flashinfer
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        group = spec.num_heads // spec.num_kv_heads
        # Tensor-core decode pays off once a KV head serves several query heads.
        self._tensor_cores = group >= 4
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_tensor_cores=self._tensor_cores)
        self._graph_decode: dict[int, Any] = {}
        self._graph_int_workspace: torch.Tensor | None = None
        self._staging = torch.empty(0, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._planned: torch.cuda.Event | None = None
        self._window_left = spec.sliding_window - 1 if spec.sliding_window else -1

    def build(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        n = common.num_reqs
        metadata = FlashInferMetadata(
            slot_mapping=common.slot_mapping[: common.num_actual_tokens], wrapper=None,
            num_tokens=common.num_actual_tokens)
        if n == 0 or common.num_actual_tokens == 0:
            return metadata
        if self._planned is not None:
            self._planned.synchronize()
        pages = self._page_lists(common)
        spec = self.spec
        kinds = {"q_data_type": spec.dtype, "kv_data_type": spec.kv_cache_dtype,
                 "o_data_type": spec.dtype, "sm_scale": 1.0 / math.sqrt(spec.head_size),
                 "window_left": self._window_left}
        if common.max_query_len == 1:
            wrapper = (self._graph_wrapper(n, common.max_seq_len) if common.cuda_graph
                       else self._decode)
            wrapper.plan(pages.indptr, pages.indices, pages.last_page_len, spec.num_heads,
                         spec.num_kv_heads, spec.head_size, spec.block_size,
                         logits_soft_cap=spec.logits_soft_cap or 0.0, **kinds)
        else:
            wrapper = self._prefill
            wrapper.plan(pages.qo_indptr, pages.indptr, pages.indices,
                         pages.last_page_len, spec.num_heads, spec.num_kv_heads,
                         spec.head_size, spec.block_size, causal=True,
                         logits_soft_cap=spec.logits_soft_cap, **kinds)
        if self.device.type == "cuda":
            self._planned = torch.cuda.Event()
            self._planned.record()
        metadata.wrapper = wrapper
        return metadata

    def _page_lists(self, common: CommonAttentionMetadata) -> PageLists:
        """The step's page lists, staged in one pinned buffer (one copy per step)."""
        if common.block_table_cpu is None:
            raise RuntimeError("FLASHINFER plans on the host: the engine must provide "
                               "CommonAttentionMetadata.block_table_cpu")
        n = common.num_reqs
        indptr, indices, last = page_lists(common.block_table_cpu.numpy(),
                                           common.seq_lens_cpu[:n].numpy(), self.spec.block_size)
        # One pinned buffer: [indptr | last_page_len | qo_indptr | indices].
        a, b, c = n + 1, 2 * n + 1, 3 * n + 2
        need = c + len(indices)
        if self._staging.numel() < need:
            self._staging = torch.empty(max(need, 2 * self._staging.numel()), dtype=torch.int32,
                                        pin_memory=self.device.type == "cuda")
        buf = self._staging.numpy()
        buf[:a] = indptr
        buf[a:b] = last
        buf[b:c] = common.query_start_loc_cpu[: n + 1].numpy()
        buf[c:need] = indices
        return PageLists(
            indptr=self._staging[:a],
            indices=self._staging[c:need].to(self.device, non_blocking=True),
            last_page_len=self._staging[a:b],
            qo_indptr=self._staging[b:c],
        )

    def _graph_wrapper(self, size: int, max_seq_len: int) -> Any:
        """The decode wrapper of one CUDA-graph batch size, with buffers for the longest
        possible page lists (``max_seq_len`` is the engine's ``max_model_len`` for graph
        batches)."""
        wrapper = self._graph_decode.get(size)
        if wrapper is None:
            max_pages = size * -(-max_seq_len // self.spec.block_size)
            i32 = {"dtype": torch.int32, "device": self.device}
            wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_cuda_graph=True,
                use_tensor_cores=self._tensor_cores,
                paged_kv_indptr_buffer=torch.zeros(size + 1, **i32),
                paged_kv_indices_buffer=torch.zeros(max_pages, **i32),
                paged_kv_last_page_len_buffer=torch.zeros(size, **i32),
            )
            # The graph wrappers share one int workspace (FlashInfer's own is 8 MiB each,
            # allocated after the KV cache was sized): each replay is re-planned right before
            # it runs, on the same stream, so no two graphs need their plans at once.
            if self._graph_int_workspace is None:
                self._graph_int_workspace = torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8,
                                                        device=self.device)
            wrapper.reset_workspace_buffer(self._workspace, self._graph_int_workspace)
            self._graph_decode[size] = wrapper
        return wrapper


class FlashInferAttentionImpl(AttentionImpl):
    """Writes K/V into the pages (quantized with the layer's scales for an fp8 cache), then
    runs the step's planned wrapper."""

    def __init__(
        self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, spec: AttentionSpec
    ) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, spec)
        # The plan fixes the softmax scale at 1/sqrt(head_size); a model with its own scale
        # rescales q by this factor instead (None: no rescaling).
        ratio = scale * math.sqrt(head_size)
        self.q_factor = None if math.isclose(ratio, 1.0, rel_tol=1e-6) else ratio

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: FlashInferMetadata,
    ) -> torch.Tensor:
        n = metadata.num_tokens
        fp8 = kv_cache.dtype in FP8_DTYPES
        if fp8:  # indexed copies of fp8 go through the same bytes viewed as uint8
            write_nhd(kv_cache.view(torch.uint8),
                      quantize_kv(key, self.k_scale, kv_cache.dtype).view(torch.uint8),
                      quantize_kv(value, self.v_scale, kv_cache.dtype).view(torch.uint8),
                      metadata.slot_mapping)
        else:
            write_nhd(kv_cache, key, value, metadata.slot_mapping)
        if metadata.wrapper is None:
            return torch.zeros_like(query)
        q = query[:n].contiguous()
        if fp8 and self.k_scale is not None:  # scores are q . (stored K) * k_scale
            q = q * (self.k_scale * (self.q_factor or 1.0))
        elif self.q_factor is not None:
            q = q * self.q_factor
        out = metadata.wrapper.run(q, (kv_cache[0], kv_cache[1]))
        if fp8 and self.v_scale is not None:
            out = out * self.v_scale
        return pad_rows(out, query.shape[0])


class FlashInferAttentionBackend(AttentionBackend):
    """FlashInfer's paged attention: batch prefill and batch decode, GQA/MQA, sliding window,
    logits soft-cap, fp8 KV caches (e4m3, e5m2), CUDA graphs for decode batches."""

    name: ClassVar[str] = "FLASHINFER"
    priority: ClassVar[int] = 90
    cuda_graph_support: ClassVar[CudaGraphSupport] = CudaGraphSupport.UNIFORM_DECODE

    @classmethod
    def validate(cls, spec: AttentionSpec) -> list[str]:
        if not _flashinfer_installed():
            return [f"flashinfer is not installed ({INSTALL_HINT})"]
        reasons = []
        if spec.device_type != "cuda":
            reasons.append(f"no CUDA device (FlashInfer runs on NVIDIA GPUs; device is "
                           f"{spec.device_type!r})")
        elif spec.device_capability is not None and spec.device_capability < (8, 0):
            major, minor = spec.device_capability
            reasons.append(f"compute capability {major}.{minor} is below 8.0 (FlashInfer's "
                           "bf16/fp16 kernels need Ampere or newer)")
        fp8 = spec.kv_cache_dtype in FP8_DTYPES
        # The shared checks refuse fp8 caches; FlashInfer reads them (checked below).
        reasons += kernel_reasons(dataclasses.replace(spec, kv_cache_dtype=spec.dtype) if fp8
                                  else spec)
        if fp8 and spec.device_capability is not None and spec.device_capability < (8, 9):
            major, minor = spec.device_capability
            reasons.append(f"an fp8 KV cache needs compute capability 8.9 or newer (Ada, "
                           f"Hopper); this GPU is {major}.{minor} (use kv_cache_dtype=auto)")
        if spec.head_size not in HEAD_SIZES:
            reasons.append(f"head size {spec.head_size} is not supported (FlashInfer serves "
                           f"{', '.join(map(str, HEAD_SIZES))})")
        return reasons

    @classmethod
    def get_kv_cache_shape(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return nhd_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        return FlashInferAttentionImpl

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        return FlashInferMetadataBuilder
