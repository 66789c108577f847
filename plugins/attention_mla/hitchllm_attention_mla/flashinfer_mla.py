"""FLASHINFER_MLA: FlashInfer's paged MLA kernel (``flashinfer.mla.BatchMLAPagedAttentionWrapper``).

Every step runs in the absorbed form, prompts included. FlashInfer's MLA wrapper takes any
number of new tokens per request with a causal mask aligned to the end of the context (new
token ``i`` of a request with ``q_len`` new tokens and ``kv_len`` cached ones, the new ones
among them, sees latents ``0 .. kv_len - q_len + i``), so prompts, chunks over a cached prefix
and decodes of one step share one plan and one kernel launch per layer, over the latent cache:

- the builder plans once per step on the host: ``qo_indptr`` (query start locations),
  ``kv_indptr`` / ``kv_indices`` (each request's pages, in CSR form, from the block table)
  and ``kv_len_arr`` (context lengths), staged in one pinned buffer;
- the impl writes the new latents through the slot mapping (as TORCH_MLA does), folds
  ``W_UK`` into the query's no-rope part, runs the wrapper, which returns the latent-space
  output, and applies ``W_UV``.

For long prompts the absorbed form does more arithmetic than the expanded one (scores over
576 values per head instead of ``qk_nope + qk_rope``, 192 for V3) but reads the context once
for all heads and skips up-projecting it; which is faster for prefill is a GPU measurement,
not yet made.

Cache layout: TORCH_MLA's one tensor per layer, ``[num_blocks + 1, block_size, 576]``. The
wrapper takes the compressed KV and the rope part as two tensors ``[pages, page_size, 512]``
and ``[pages, page_size, 64]``; it gets ``cache[..., :512]`` and ``cache[..., 512:]``, strided
views (page stride ``block_size * 576``, token stride 576, last dimension contiguous).
FlashInfer's run reads each cache's page and token strides (``ckv_stride_page``,
``ckv_stride_n``, ``kpe_stride_page``, ``kpe_stride_n`` in its kernels' parameters) and loads
16-byte vectors along the last dimension, which the views allow: rows start 1152 bytes apart
in 16-bit dtypes and the rope part 1024 bytes into a row. Keeping one tensor keeps the
latent write (one indexed copy), the spare block for padding slots and the KV sizing those of
the other MLA backends; two tensors would buy FlashInfer nothing.

The softmax scale: the builder plans for every layer before any runs and does not know the
model's scale (DeepSeek's, with YaRN's mscale), so it plans with ``sm_scale = 1`` and the impl
multiplies the query by its layer's scale.

CUDA graphs: not captured (``CudaGraphSupport.NEVER``), decode steps included. A captured
wrapper needs ``use_cuda_graph=True`` with index buffers of its own per batch size, re-planned
before each replay (as the FLASHINFER plugin does for its decode wrapper); not done yet.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from hitchllm.attention import (
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionSpec,
    CommonAttentionMetadata,
    pad_rows,
)
from hitchllm.layers import LinearBase
from hitchllm_attention_mla.layer import MLAAttentionImpl, MLADims
from hitchllm_attention_mla.ranking import MLA_BACKEND_PRIORITY
from hitchllm_attention_mla.torch_mla import TorchMLABackend, TorchMLAImpl, mla_reasons

#: The latent split FlashInfer's MLA kernels are built for (DeepSeek-V2/V3's): compressed KV
#: (``head_dim_ckv``) and rope part (``head_dim_kpe``).
KV_LORA_RANK = 512
ROPE_DIM = 64
#: The dtypes its kernels take (16-bit tensor-core products) for queries and the cache alike.
DTYPES = (torch.float16, torch.bfloat16)
#: Float workspace for split-KV partial outputs; FlashInfer suggests 128 MB.
WORKSPACE_BYTES = 128 * 1024 * 1024
INSTALL_HINT = "pip install 'hitchllm-attention-mla[flashinfer]' (or flashinfer-python)"


def flashinfer_mla_problem(device_type: str) -> str | None:
    """Why FlashInfer's MLA wrapper cannot be used on ``device_type``, or None: not installed,
    no CUDA device, or installed but failing to import (a build for another torch or CUDA).
    Imports flashinfer only for a CUDA device."""
    if importlib.util.find_spec("flashinfer") is None:
        return f"flashinfer is not installed ({INSTALL_HINT})"
    if device_type != "cuda":
        return (f"no CUDA device (FlashInfer's MLA kernel runs on NVIDIA GPUs; device is "
                f"{device_type!r})")
    try:
        from flashinfer.mla import BatchMLAPagedAttentionWrapper  # noqa: F401
    except Exception as exc:  # an install that cannot load must be a reason, not a crash
        return (f"flashinfer is installed but flashinfer.mla.BatchMLAPagedAttentionWrapper "
                f"cannot be imported ({type(exc).__name__}: {exc}); reinstall it for this torch "
                f"and CUDA ({INSTALL_HINT})")
    return None


def mla_page_lists(block_table: np.ndarray, seq_lens: np.ndarray, block_size: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """FlashInfer's page lists for requests with context lengths ``seq_lens`` [n] (new tokens
    included) and block table ``block_table`` [n, cols]: ``kv_indptr`` [n + 1] (request
    ``i``'s pages are ``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]``) and ``kv_indices``, the
    first ``ceil(seq_lens[i] / block_size)`` blocks of each row, request after request;
    int32."""
    pages = -(-seq_lens.astype(np.int64) // block_size)
    indptr = np.zeros(len(seq_lens) + 1, dtype=np.int32)
    np.cumsum(pages, out=indptr[1:])
    used = np.arange(block_table.shape[1])[None, :] < pages[:, None]
    return indptr, block_table[used].astype(np.int32)


@dataclass
class FlashInferMLAPlan:
    """What ``BatchMLAPagedAttentionWrapper.plan`` takes for one step: host int32 tensors,
    views of the builder's pinned staging buffer (the plan copies them to the device
    asynchronously)."""

    qo_indptr: torch.Tensor  # [n + 1]
    kv_indptr: torch.Tensor  # [n + 1]
    kv_indices: torch.Tensor  # [kv_indptr[-1]]
    kv_len_arr: torch.Tensor  # [n]


@dataclass
class FlashInferMLAMetadata:
    """The step's slot mapping and the wrapper planned for it (None: no tokens)."""

    slot_mapping: torch.Tensor
    wrapper: Any
    num_tokens: int
    num_heads: int  # the heads the wrapper was planned for


class FlashInferMLAMetadataBuilder(AttentionMetadataBuilder):
    """Owns the workspace and the wrapper, and plans the wrapper once per step.

    The plan's host inputs live in a pinned staging buffer copied to the device
    asynchronously; with async scheduling the next step is planned while this one may still
    be queued, so before writing the buffer again the builder waits for an event recorded
    after the previous plan (normally long passed: it is only a guard).
    """

    def __init__(self, spec: AttentionSpec, device: torch.device) -> None:
        super().__init__(spec, device)
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._wrapper = BatchMLAPagedAttentionWrapper(self._workspace)
        self._pinned = device.type == "cuda"
        self._staging = torch.empty(0, dtype=torch.int32, pin_memory=self._pinned)
        self._planned: torch.cuda.Event | None = None

    def build(self, common: CommonAttentionMetadata) -> FlashInferMLAMetadata:
        if common.cuda_graph:
            raise ValueError("FLASHINFER_MLA is never captured into CUDA graphs (its backend "
                             "declares CudaGraphSupport.NEVER); got a CUDA-graph batch")
        metadata = FlashInferMLAMetadata(
            slot_mapping=common.slot_mapping[: common.num_actual_tokens], wrapper=None,
            num_tokens=common.num_actual_tokens, num_heads=self.spec.num_heads)
        if common.num_reqs == 0 or common.num_actual_tokens == 0:
            return metadata
        if self._planned is not None:
            self._planned.synchronize()
        plan = self.plan_inputs(common)
        spec = self.spec
        self._wrapper.plan(
            qo_indptr=plan.qo_indptr, kv_indptr=plan.kv_indptr, kv_indices=plan.kv_indices,
            kv_len_arr=plan.kv_len_arr, num_heads=spec.num_heads, head_dim_ckv=KV_LORA_RANK,
            head_dim_kpe=ROPE_DIM, page_size=spec.block_size,
            # One new token per request: the causal mask changes nothing.
            causal=common.max_query_len > 1, sm_scale=1.0, q_data_type=spec.dtype,
            kv_data_type=spec.kv_cache_dtype)
        if self.device.type == "cuda":
            self._planned = torch.cuda.Event()
            self._planned.record()
        metadata.wrapper = self._wrapper
        return metadata

    def plan_inputs(self, common: CommonAttentionMetadata) -> FlashInferMLAPlan:
        """The step's plan inputs, staged in one pinned buffer:
        ``[qo_indptr | kv_indptr | kv_len_arr | kv_indices]``."""
        if common.block_table_cpu is None:
            raise RuntimeError("FLASHINFER_MLA plans on the host: the engine must provide "
                               "CommonAttentionMetadata.block_table_cpu")
        n = common.num_reqs
        seq_lens = common.seq_lens_cpu[:n].numpy()
        kv_indptr, kv_indices = mla_page_lists(common.block_table_cpu.numpy(), seq_lens,
                                               self.spec.block_size)
        a, b, c = n + 1, 2 * n + 2, 3 * n + 2
        need = c + len(kv_indices)
        if self._staging.numel() < need:
            self._staging = torch.empty(max(need, 2 * self._staging.numel()), dtype=torch.int32,
                                        pin_memory=self._pinned)
        buf = self._staging.numpy()
        buf[:a] = common.query_start_loc_cpu[: n + 1].numpy()
        buf[a:b] = kv_indptr
        buf[b:c] = seq_lens
        buf[c:need] = kv_indices
        return FlashInferMLAPlan(qo_indptr=self._staging[:a], kv_indptr=self._staging[a:b],
                                 kv_indices=self._staging[c:need], kv_len_arr=self._staging[b:c])


class FlashInferMLAImpl(MLAAttentionImpl):
    """Writes the new latents, then runs the step's planned wrapper in the absorbed form."""

    def attach(self, dims: MLADims, kv_b_proj: LinearBase) -> None:
        """As ``MLAAttentionImpl.attach``; raises ``ValueError`` for a latent split other than
        FlashInfer's 512 + 64 (the spec the backend validated carries only their sum)."""
        if (dims.kv_lora_rank, dims.qk_rope_head_dim) != (KV_LORA_RANK, ROPE_DIM):
            raise ValueError(
                f"FLASHINFER_MLA needs kv_lora_rank {KV_LORA_RANK} and qk_rope_head_dim "
                f"{ROPE_DIM} (FlashInfer's MLA kernel is built for DeepSeek-V2/V3's latent); "
                f"this model has {dims.kv_lora_rank} and {dims.qk_rope_head_dim}: use "
                "TRITON_MLA or TORCH_MLA")
        super().attach(dims, kv_b_proj)

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None,
        kv_cache: torch.Tensor, metadata: FlashInferMLAMetadata,
    ) -> torch.Tensor:
        d = self.dims
        TorchMLAImpl.write_latents(kv_cache, key[:, 0], metadata.slot_mapping)
        if metadata.wrapper is None:
            return query.new_zeros(query.shape[0], d.num_heads, d.v_head_dim)
        if metadata.num_heads != d.num_heads:
            raise ValueError(f"FLASHINFER_MLA planned {metadata.num_heads} heads per layer, "
                             f"this layer has {d.num_heads}")
        n = metadata.num_tokens
        w_uk, w_uv = self.up_weights()
        q_nope, q_pe = query[:n].split([d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)
        # The plan's softmax scale is 1: the layer's scale multiplies the query instead.
        q_lat = (torch.einsum("thd,hdr->thr", q_nope, w_uk) * self.scale).contiguous()
        q_pe = (q_pe * self.scale).contiguous()
        o_lat = metadata.wrapper.run(q_lat, q_pe, kv_cache[..., : d.kv_lora_rank],
                                     kv_cache[..., d.kv_lora_rank:])
        return pad_rows(torch.einsum("thr,hvr->thv", o_lat, w_uv), query.shape[0])


class FlashInferMLABackend(TorchMLABackend):
    """FlashInfer's paged MLA kernel for every step (absorbed form); NVIDIA GPUs (sm_80+),
    fp16/bf16, DeepSeek's 512 + 64 latent, any page size. Eager only (no CUDA graphs)."""

    name: ClassVar[str] = "FLASHINFER_MLA"
    priority: ClassVar[int] = MLA_BACKEND_PRIORITY["FLASHINFER_MLA"]

    @classmethod
    def validate(cls, spec: AttentionSpec) -> list[str]:
        reasons = mla_reasons(spec, cls.name)
        problem = flashinfer_mla_problem(spec.device_type)
        if problem is not None:
            return [*reasons, problem]
        if spec.device_capability is not None and spec.device_capability < (8, 0):
            major, minor = spec.device_capability
            reasons.append(f"compute capability {major}.{minor} is below 8.0 (FlashInfer's MLA "
                           "kernel needs Ampere or newer)")
        if spec.dtype not in DTYPES:
            reasons.append(f"dtype {spec.dtype} is not supported (FlashInfer's MLA kernel takes "
                           "bfloat16 or float16)")
        if spec.use_mla and spec.head_size != KV_LORA_RANK + ROPE_DIM:
            reasons.append(f"latent width {spec.head_size} is not supported (FlashInfer's MLA "
                           f"kernel needs kv_lora_rank {KV_LORA_RANK} + qk_rope_head_dim "
                           f"{ROPE_DIM} = {KV_LORA_RANK + ROPE_DIM}, DeepSeek-V2/V3's)")
        return reasons

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        return FlashInferMLAImpl

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        return FlashInferMLAMetadataBuilder
