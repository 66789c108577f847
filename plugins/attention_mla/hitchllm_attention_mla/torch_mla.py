"""TORCH_MLA: multi-head latent attention in plain PyTorch, the reference MLA backend.

It runs anywhere PyTorch runs. The cache is one tensor ``[num_blocks + 1, block_size, latent]``
per layer (``latent = kv_lora_rank + qk_rope``); the extra last block absorbs writes of padding
slots (-1). The step is split as the core TORCH backend splits it (its metadata builder is
reused): requests with several new tokens (prompts, prompt chunks, drafts) run one by one in
the expanded form (context up-projected to per-head K/V, SDPA, causal with the cached prefix
as offset); the others (decodes) run together in the absorbed form over the latent cache,
padded to the longest context.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from hitchllm.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionSpec,
    KVCacheKind,
    KVCacheSpec,
)
from hitchllm.attention.torch_backend import (
    BatchedRequests,
    PrefillRequest,
    TorchAttentionMetadata,
    TorchAttentionMetadataBuilder,
    without_cudnn_sdpa,
)
from hitchllm_attention_mla.layer import MLAAttentionImpl
from hitchllm_attention_mla.ranking import MLA_BACKEND_PRIORITY

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def mla_reasons(spec: AttentionSpec, backend: str) -> list[str]:
    """Reasons MLA backend ``backend`` cannot serve ``spec`` whatever its kernel: a model
    without MLA, a KV-cache dtype other than the model's, logits soft-capping."""
    reasons = []
    if not spec.use_mla:
        reasons.append("this backend serves multi-head latent attention (DeepSeek-V2/V3) only; "
                       "this model has standard attention (use TORCH, TRITON_ATTN, ... or let "
                       "auto choose)")
    if spec.kv_cache_dtype != spec.dtype:
        reasons.append(f"KV-cache dtype {spec.kv_cache_dtype} is not supported: {backend} "
                       "keeps the latent in the model dtype (use kv_cache_dtype=auto)")
    if spec.logits_soft_cap is not None:
        reasons.append("logits soft-capping is not supported with MLA")
    return reasons


class TorchMLAImpl(MLAAttentionImpl):
    """Expanded attention for prefills, absorbed attention for decodes, over the latent cache."""

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None,
        kv_cache: torch.Tensor, metadata: TorchAttentionMetadata,
    ) -> torch.Tensor:
        self.write_latents(kv_cache, key[:, 0], metadata.slot_mapping)
        out = query.new_zeros(query.shape[0], self.dims.num_heads, self.dims.v_head_dim)
        if metadata.prefills:
            # Not cuDNN's SDPA (its per-shape plans were 35% of a fresh DeepSeek-V2-Lite
            # run's first pass on an H100); entered once for the step's prompts.
            with without_cudnn_sdpa():
                for p in metadata.prefills:
                    self._attend_prefill(query, kv_cache, metadata.block_table[p.row], p, out)
        if metadata.batched is not None:
            b = metadata.batched
            out[b.token_idx] = self._attend_absorbed(query[b.token_idx], kv_cache, b)
        return out

    @staticmethod
    def write_latents(kv_cache: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor
                      ) -> None:
        """Write ``latent`` ([>= num_slots, width]) to its slots; padding slots (-1) go to
        the spare last block."""
        flat = kv_cache.view(-1, kv_cache.shape[-1])
        sink = flat.shape[0] - kv_cache.shape[1]
        slots = slot_mapping.masked_fill(slot_mapping < 0, sink)
        flat.index_copy_(0, slots, latent[: len(slots)].to(flat.dtype))

    @staticmethod
    def gather(kv_cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int
               ) -> torch.Tensor:
        """The first ``num_tokens`` latents of the blocks in ``block_table`` ([..., cols]) as
        [..., num_tokens, width]."""
        cols = -(-num_tokens // kv_cache.shape[1])
        blocks = kv_cache[block_table[..., :cols].long()]  # [..., cols, block_size, width]
        return blocks.flatten(-3, -2)[..., :num_tokens, :]

    def _attend_prefill(
        self, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
        p: PrefillRequest, out: torch.Tensor,
    ) -> None:
        d = self.dims
        rows = slice(p.query_start, p.query_start + p.query_len)
        seq_len = p.context_len + p.query_len
        latent = self.gather(kv_cache, block_table, seq_len).to(query.dtype)
        k, v = self.expand(latent[:, : d.kv_lora_rank], latent[:, d.kv_lora_rank:])
        q = query[rows].transpose(0, 1)[None]  # [1, heads, q_len, qk]
        k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        if p.context_len == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:  # causal with the cached prefix as offset (SDPA's is_causal aligns top-left)
            qpos = p.context_len + torch.arange(p.query_len, device=q.device)[:, None]
            allowed = torch.arange(seq_len, device=q.device)[None, :] <= qpos
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale)
        out[rows] = o[0].transpose(0, 1)

    def _attend_absorbed(self, query: torch.Tensor, kv_cache: torch.Tensor, b: BatchedRequests
                         ) -> torch.Tensor:
        """Several requests at once in the absorbed form: queries padded to the longest
        query, latents to the longest context, with a mask."""
        d = self.dims
        w_uk, w_uv = self.up_weights()
        q_nope, q_pe = query.split([d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)
        q_lat = torch.einsum("thd,hdr->thr", q_nope, w_uk)
        q = torch.cat((q_lat, q_pe), dim=-1)  # [tokens, heads, latent]
        n, max_q, max_k = b.num_reqs, b.max_query_len, b.max_seq_len
        padded = q.new_zeros(n, max_q, d.num_heads, d.latent_width)
        padded[b.token_req, b.token_qpos] = q
        latent = self.gather(kv_cache, b.block_table, max_k).to(query.dtype)  # [n, max_k, w]
        scores = padded.flatten(1, 2) @ latent.transpose(1, 2)  # [n, max_q * heads, max_k]
        scores = scores.float().view(n, max_q, d.num_heads, max_k) * self.scale
        kpos = torch.arange(max_k, device=query.device)
        qpos = b.context_lens[:, None] + torch.arange(max_q, device=query.device)
        allowed = (kpos <= qpos[:, :, None]) & (kpos < b.seq_lens[:, None, None])
        scores = scores.masked_fill(~allowed[:, :, None], float("-inf"))
        probs = scores.softmax(-1).to(latent.dtype).flatten(1, 2)
        o_lat = (probs @ latent[..., : d.kv_lora_rank]).view(n, max_q, d.num_heads, -1)
        return torch.einsum("thr,hvr->thv", o_lat[b.token_req, b.token_qpos], w_uv)


class TorchMLABackend(AttentionBackend):
    """Pure-PyTorch MLA; the MLA backend on machines without an accelerated one."""

    name: ClassVar[str] = "TORCH_MLA"
    priority: ClassVar[int] = MLA_BACKEND_PRIORITY["TORCH_MLA"]

    @classmethod
    def validate(cls, spec: AttentionSpec) -> list[str]:
        reasons = mla_reasons(spec, cls.name)
        if spec.dtype not in _SUPPORTED_DTYPES:
            reasons.append(f"dtype {spec.dtype} is not supported (use float32/float16/bfloat16)")
        return reasons

    @classmethod
    def get_kv_cache_shape(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        if num_kv_heads != 1:
            raise ValueError(f"an MLA cache holds one latent per token, not {num_kv_heads} heads")
        return (num_blocks + 1, block_size, head_size)

    @classmethod
    def get_kv_cache_shape_for_spec(cls, num_blocks: int, kv_spec: KVCacheSpec
                                    ) -> tuple[int, ...]:
        if kv_spec.kind is not KVCacheKind.MLA_LATENT:
            raise ValueError(f"{cls.name} stores MLA latent caches only, not {kv_spec.kind.value}")
        return cls.get_kv_cache_shape(num_blocks, kv_spec.block_size, 1, kv_spec.head_size)

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        return TorchMLAImpl

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        return TorchAttentionMetadataBuilder
