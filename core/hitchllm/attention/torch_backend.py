"""TORCH: paged attention in plain PyTorch, the reference every other backend is tested against.

It runs anywhere PyTorch runs and supports everything the core supports (GQA, sliding window,
logits soft-cap, chunked prefill over a cached prefix, mixed prefill/decode batches). It is
written for clarity first: each step gathers each request's context from the paged cache into
contiguous tensors. Requests with several new tokens (prompts) attend one by one through SDPA,
causal without a mask where they have no cached prefix; decodes attend together, padded to the
longest context, with a grouped matmul that never copies K/V per query head.

The cache holds K/V in the model's dtype or in fp8 (``kv_cache_dtype``): fp8 values are
quantized on write with the layer's ``k_scale`` / ``v_scale`` and dequantized as they are
gathered, so attention itself always runs in the model's dtype.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from hitchllm.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionSpec,
    CommonAttentionMetadata,
)
from hitchllm.attention.kv_cache_spec import FP8_DTYPES
from hitchllm.attention.kv_quant import dequantize_kv, quantize_kv

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor viewed as uint8 (the same bytes): PyTorch's indexed copies and
    selections are not implemented for float8 dtypes on every device."""
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t


_cudnn_sdpa_lock = threading.Lock()
_cudnn_sdpa_users = 0
_cudnn_sdpa_was_enabled = True


@contextmanager
def without_cudnn_sdpa() -> Iterator[None]:
    """SDPA without cuDNN's kernel inside the block, for attention whose shapes change from
    call to call (every new prompt length): cuDNN builds a plan the first time it meets a
    shape, and on an H100 (torch 2.11) SDPA picked it for GQA prompts and paid 100-190 ms for
    each new prompt length against 0.05-0.4 ms a call otherwise. SDPA's switches are
    process-wide, so blocks on several threads (two engines in one process) share one count:
    the first to enter turns cuDNN's kernel off, the last to leave restores what it found.
    The other kernels' switches are left as the user set them."""
    global _cudnn_sdpa_users, _cudnn_sdpa_was_enabled
    with _cudnn_sdpa_lock:
        if _cudnn_sdpa_users == 0:
            _cudnn_sdpa_was_enabled = torch.backends.cuda.cudnn_sdp_enabled()
            torch.backends.cuda.enable_cudnn_sdp(False)
        _cudnn_sdpa_users += 1
    try:
        yield
    finally:
        with _cudnn_sdpa_lock:
            _cudnn_sdpa_users -= 1
            if _cudnn_sdpa_users == 0:
                torch.backends.cuda.enable_cudnn_sdp(_cudnn_sdpa_was_enabled)


@dataclass
class BatchedRequests:
    """Requests attended together, padded to the longest query and context among them."""

    token_idx: torch.Tensor  # [num_tokens] int64: packed index of each of their tokens
    block_table: torch.Tensor  # [n, max_blocks] int32
    seq_lens: torch.Tensor  # [n] int64
    context_lens: torch.Tensor  # [n] int64: tokens cached before this step
    token_req: torch.Tensor  # [num_tokens] int64: which of the n requests each token is
    token_qpos: torch.Tensor  # [num_tokens] int64: index of the token within its query
    num_reqs: int
    max_query_len: int
    max_seq_len: int


@dataclass
class PrefillRequest:
    """A request with several new tokens, attended on its own."""

    row: int  # request index in the step
    query_start: int
    query_len: int
    context_len: int  # tokens cached before this step: the causal offset


@dataclass
class TorchAttentionMetadata:
    """Per-step metadata for the TORCH backend: requests with several new tokens (prefills,
    prompt chunks, speculative drafts) each run alone through SDPA's causal path; the others
    (decodes) run together, padded. With logits soft-capping every request is batched."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    batched: BatchedRequests | None
    prefills: list[PrefillRequest]


class TorchAttentionMetadataBuilder(AttentionMetadataBuilder):
    """Splits the step's requests into the batched group and the ones run alone, on the host."""

    def build(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        n = common.num_reqs
        qsl = common.query_start_loc_cpu[: n + 1].long()
        query_lens = qsl[1:] - qsl[:-1]
        context_lens = common.num_computed_tokens_cpu[:n].long()
        alone = (query_lens > 1) & (self.spec.logits_soft_cap is None)
        prefills = [PrefillRequest(i, int(qsl[i]), int(query_lens[i]), int(context_lens[i]))
                    for i in torch.nonzero(alone).flatten().tolist()]
        batched = None
        rows = torch.nonzero(~alone).flatten()
        if len(rows):
            lens = query_lens[rows]
            num_tokens = int(lens.sum())
            token_req = torch.repeat_interleave(torch.arange(len(rows)), lens,
                                                output_size=num_tokens)
            starts = torch.cumsum(lens, 0) - lens
            token_qpos = torch.arange(num_tokens) - starts[token_req]
            token_idx = qsl[rows][token_req] + token_qpos
            seq_lens = common.seq_lens_cpu[:n].long()[rows]
            rows_dev = self._to_device(rows)
            batched = BatchedRequests(
                token_idx=self._to_device(token_idx),
                block_table=common.block_table[:n][rows_dev],
                seq_lens=self._to_device(seq_lens),
                context_lens=self._to_device(context_lens[rows]),
                token_req=self._to_device(token_req),
                token_qpos=self._to_device(token_qpos),
                num_reqs=len(rows),
                max_query_len=int(lens.max()),
                max_seq_len=int(seq_lens.max()),
            )
        return TorchAttentionMetadata(
            slot_mapping=common.slot_mapping[: common.num_actual_tokens],
            block_table=common.block_table[:n],
            batched=batched,
            prefills=prefills,
        )

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)


class TorchAttentionImpl(AttentionImpl):
    """SDPA over each request's context gathered from the paged cache."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
    ) -> torch.Tensor:
        self.write_kv_cache(kv_cache, key, value, metadata.slot_mapping)
        key_cache, value_cache = kv_cache.unbind(0)
        out = torch.zeros_like(query)
        self.attend_prefills(query, key_cache, value_cache, metadata.block_table,
                             metadata.prefills, out)
        if metadata.batched is not None:
            b = metadata.batched
            out[b.token_idx] = self._attend_batched(query[b.token_idx], key_cache, value_cache, b)
        return out

    def write_kv_cache(
        self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write ``key``/``value`` ([>= num_slots, kv_heads, d]) to their slots of the
        head-major cache (a layout other backends may share, see ``get_kv_cache_shape``)."""
        # Head-major layout [kv_heads, blocks, block_size, d]: gathering a request's blocks
        # for one head yields its context as one contiguous [len, d] matrix.
        key_cache, value_cache = kv_cache.unbind(0)
        block_size = key_cache.shape[2]
        flat_k = key_cache.view(self.num_kv_heads, -1, self.head_size)
        flat_v = value_cache.view(self.num_kv_heads, -1, self.head_size)
        # The cache holds one extra block at the end: padding slots (-1) are redirected there
        # so the write needs no data-dependent indexing (which would sync with the host).
        sink = flat_k.shape[1] - block_size
        slots = torch.where(slot_mapping < 0, torch.full_like(slot_mapping, sink), slot_mapping)
        n = len(slots)
        new_k = quantize_kv(key[:n], self.k_scale, flat_k.dtype).transpose(0, 1)
        new_v = quantize_kv(value[:n], self.v_scale, flat_v.dtype).transpose(0, 1)
        _as_bytes(flat_k).index_copy_(1, slots, _as_bytes(new_k))
        _as_bytes(flat_v).index_copy_(1, slots, _as_bytes(new_v))

    def _gather(
        self, cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int, dtype: torch.dtype,
        scale: torch.Tensor | None,
    ) -> torch.Tensor:
        """Whole blocks of ``block_table`` ([..., cols]) as [kv_heads, ..., cols * block, d]
        in ``dtype`` (an fp8 cache dequantized with ``scale``)."""
        block_size = cache.shape[2]
        blocks = block_table.reshape(-1).long()
        # Selecting rows of a [kv_heads, blocks, block_size * d] view copies whole blocks at
        # a time (up to 1.5x faster on CPU than selecting along dim 1 of the 4-d cache).
        rows = _as_bytes(cache.view(self.num_kv_heads, cache.shape[1], -1))
        rows = rows.index_select(1, blocks).view(cache.dtype)
        shape = (self.num_kv_heads, *block_table.shape, block_size, self.head_size)
        return dequantize_kv(rows.view(shape).flatten(-3, -2)[..., :num_tokens, :], scale, dtype)

    def attend_prefills(
        self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        block_table: torch.Tensor, prefills: list[PrefillRequest], out: torch.Tensor,
    ) -> None:
        """Each of ``prefills`` through ``attend_request``, into its rows of ``out`` (all of
        them inside one ``without_cudnn_sdpa`` block)."""
        if not prefills:
            return
        with without_cudnn_sdpa():
            for p in prefills:
                rows = slice(p.query_start, p.query_start + p.query_len)
                out[rows] = self.attend_request(query[rows], key_cache, value_cache,
                                                block_table[p.row], p.context_len)

    def attend_request(
        self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        block_table: torch.Tensor, context_len: int,
    ) -> torch.Tensor:
        """One request's ``q_len`` new tokens ([q_len, heads, d]) over its ``context_len +
        q_len`` context, gathered from the head-major caches through its ``block_table`` row,
        with SDPA. Backends sharing TORCH's cache layout may call it for long queries."""
        q_len = q.shape[0]
        seq_len = context_len + q_len
        cols = -(-seq_len // key_cache.shape[2])
        k = self._gather(key_cache, block_table[:cols], seq_len, q.dtype, self.k_scale)[None]
        v = self._gather(value_cache, block_table[:cols], seq_len, q.dtype, self.v_scale)[None]
        q = q.transpose(0, 1)[None]  # [1, heads, q_len, d]
        gqa = self.num_heads != self.num_kv_heads
        window = self.spec.sliding_window
        if context_len == 0 and (window is None or window >= seq_len):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                                 enable_gqa=gqa)
        else:  # causal with an offset (SDPA's is_causal aligns top-left), maybe windowed
            qpos = context_len + torch.arange(q_len, device=q.device)[:, None]
            kpos = torch.arange(seq_len, device=q.device)[None, :]
            allowed = kpos <= qpos
            if window is not None:
                allowed &= qpos - kpos < window
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale,
                                                 enable_gqa=gqa)
        return out[0].transpose(0, 1)

    def _attend_batched(
        self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        b: BatchedRequests,
    ) -> torch.Tensor:
        """Several requests at once, padded: queries to the longest query, contexts to the
        longest context, with a mask."""
        n, max_q, max_k = b.num_reqs, b.max_query_len, b.max_seq_len
        cols = min(-(-max_k // key_cache.shape[2]), b.block_table.shape[1])
        k = self._gather(key_cache, b.block_table[:, :cols], max_k, query.dtype, self.k_scale)
        v = self._gather(value_cache, b.block_table[:, :cols], max_k, query.dtype, self.v_scale)

        q = query.new_zeros(n, max_q, self.num_heads, self.head_size)
        q[b.token_req, b.token_qpos] = query
        q = q.transpose(1, 2)  # [n, heads, max_q, d]

        kpos = torch.arange(max_k, device=query.device)
        qpos = b.context_lens[:, None] + torch.arange(max_q, device=query.device)
        kp = kpos[None, None, :]
        allowed = (kp <= qpos[:, :, None]) & (kp < b.seq_lens[:, None, None])
        if self.spec.sliding_window is not None:
            allowed &= qpos[:, :, None] - kp < self.spec.sliding_window
        out = self._grouped(q, k, v, allowed[:, None])
        return out.transpose(1, 2)[b.token_req, b.token_qpos]

    def _grouped(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor
    ) -> torch.Tensor:
        n, _, max_q, d = q.shape
        group = self.num_heads // self.num_kv_heads
        # [kv_heads, n, group * max_q, d]: the query heads of a group share their K/V, which
        # arrive as [kv_heads, n, len, d], so the batched matmuls need no copies.
        qg = q.reshape(n, self.num_kv_heads, group * max_q, d).transpose(0, 1)
        scores = (qg @ k.transpose(-1, -2)).transpose(0, 1).float() * self.scale
        if self.spec.logits_soft_cap is not None:
            cap = self.spec.logits_soft_cap
            scores = cap * torch.tanh(scores / cap)
        scores = scores.view(n, self.num_kv_heads, group, max_q, -1)
        scores = scores.masked_fill(~allowed[:, :, None], float("-inf"))
        probs = scores.softmax(-1).to(v.dtype).view(n, self.num_kv_heads, group * max_q, -1)
        out = probs.transpose(0, 1) @ v  # [kv_heads, n, group * max_q, d]
        return out.transpose(0, 1).reshape(n, self.num_heads, max_q, d)


class TorchAttentionBackend(AttentionBackend):
    """Pure-PyTorch paged attention; the default on machines with no accelerator plugin."""

    name: ClassVar[str] = "TORCH"
    priority: ClassVar[int] = 0

    @classmethod
    def validate(cls, spec: AttentionSpec) -> list[str]:
        reasons = []
        if spec.use_mla:
            reasons.append("MLA models need an MLA attention backend from a plugin (TORCH_MLA "
                           "or TRITON_MLA: pip install -e plugins/attention_mla)")
        if spec.dtype not in _SUPPORTED_DTYPES:
            reasons.append(f"dtype {spec.dtype} is not supported (use float32/float16/bfloat16)")
        if spec.kv_cache_dtype != spec.dtype and spec.kv_cache_dtype not in FP8_DTYPES:
            reasons.append(f"KV-cache dtype {spec.kv_cache_dtype} is not supported (use the "
                           "model dtype, or fp8_e4m3 / fp8_e5m2)")
        if spec.num_heads % spec.num_kv_heads:
            reasons.append(
                f"{spec.num_heads} query heads are not a multiple of {spec.num_kv_heads} KV heads"
            )
        return reasons

    @classmethod
    def get_kv_cache_shape(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        # Head-major; one extra block absorbs writes of padding slots (see
        # TorchAttentionImpl.forward).
        return (2, num_kv_heads, num_blocks + 1, block_size, head_size)

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        return TorchAttentionImpl

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        return TorchAttentionMetadataBuilder
