"""TRITON_ATTN: hitchllm's own paged attention kernels, written in Triton."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import ClassVar

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
)
from hitchllm.attention.triton_support import triton_device_reasons
from hitchllm_attention_triton.config import SHORT_QUERY, KernelConfig, choose_kernel_config

MAX_HEAD_SIZE = 256
#: Per fp8 format: largest finite value, mantissa bits, smallest normal exponent (what the
#: cache write rounds to; see kernels._fp8_grid).
FP8_FORMATS = {
    torch.float8_e4m3fn: (448.0, 3, -6),
    torch.float8_e5m2: (57344.0, 2, -14),
}
#: The dtype of fp8 V's words of 2 or 4 values.
V_WORD_DTYPES = {2: torch.int16, 4: torch.int32}


@dataclass
class TritonAttentionMetadata:
    """Per-step inputs of the kernels (device tensors) and the launch configuration."""

    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    # [num_tiles] int32 each: the request of each query tile and the tile's first query index
    # within it. None for decode batches, where tile i is request i's only token.
    tile_req: torch.Tensor | None
    tile_q0: torch.Tensor | None
    num_tiles: int
    num_tokens: int
    kernel: KernelConfig
    # Decode batches on a GPU: the requests by descending context length ([num_reqs] int64),
    # the order in which the kernel's programs take them (see ``longest_first``).
    order: torch.Tensor | None = None
    # Prompt steps with many decoding requests (see ``decodes_apart``): those requests, longest
    # context first, and the decode configuration of their own launch; the tiles hold the rest.
    decode_reqs: torch.Tensor | None = None
    decode_kernel: KernelConfig | None = None


class TritonAttentionMetadataBuilder(AttentionMetadataBuilder):
    """Cuts every request's new tokens into query tiles and picks the launch configuration.

    Decode batches need no tiles of their own (request i is tile i) and so reference only the
    engine's buffers, which makes them safe to capture into CUDA graphs; their configuration
    depends on the batch size and ``max_seq_len`` only (the engine's ``max_model_len`` for graph
    batches). The tiles of a graph batch of ``q > 1`` tokens per request (speculative
    verification) depend on its size and ``q`` only: they are computed once per shape and kept,
    so a captured graph reads the same tensors on every replay.
    """

    def __init__(self, spec: AttentionSpec, device: torch.device) -> None:
        super().__init__(spec, device)
        self.num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else 4)
        # Tests set this to exercise split-KV with a given number of partitions; the tuning
        # benchmark sets a whole launch configuration.
        self.force_num_splits: int | None = None
        self.kernel_override: KernelConfig | None = None
        self._graph_tiles: dict[tuple[int, int, int], tuple[torch.Tensor, int]] = {}
        # Decode programs take requests longest context first when they fill more than two
        # waves of SMs: contexts of a batch differ by up to the model length, and in index
        # order a long request's programs may start last and run on alone while the rest of
        # the GPU waits. On an H100 (benchmarks/attention.py --order): 1.05-1.17x faster at
        # 32 to 256 requests of mixed lengths, the same on equal lengths; forced at 8-16
        # requests (one wave, a scratch run) 1-3% slower, hence the threshold. The split counts
        # chosen since (up to four waves) put batches of 5 requests or more of 8 KV heads past
        # it; the decode-tiles grid (4-160 requests) was timed with it, index order at 5-16
        # was not. A graph replayed without a build (the EAGLE draft chain) keeps its size's
        # last order: a permutation all the same, so only the balance is lost.
        self.longest_first = self.device.type == "cuda"
        self._graph_order: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # A prompt step's decoding requests in a decode launch of their own when they alone
        # fill more than two waves of SMs: in the prompt tiles each takes a tile of up to
        # 128 query rows for its one query and walks its context 32 tokens at a time.
        self.decodes_apart = self.device.type == "cuda"
        # The longest context CUDA-graph batches choose their configuration by (the engine's
        # max_model_len): decodes apart take theirs by it too, so that they run a kernel variant
        # the graphs' capture compiled at start-up rather than one of their own.
        self._graph_max_seq_len: int | None = None

    def build(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        n = common.num_reqs
        spec = self.spec
        if common.cuda_graph:
            self._graph_max_seq_len = common.max_seq_len
        kernel = choose_kernel_config(
            num_reqs=n, max_query_len=common.max_query_len, max_seq_len=common.max_seq_len,
            num_kv_heads=spec.num_kv_heads, group=spec.num_heads // spec.num_kv_heads,
            head_size=spec.head_size, num_sms=self.num_sms, on_gpu=self.device.type == "cuda",
            force_splits=self.force_num_splits, kv_bytes=spec.kv_cache_dtype.itemsize,
        ) if self.kernel_override is None else self.kernel_override
        metadata = TritonAttentionMetadata(
            slot_mapping=common.slot_mapping[: common.num_actual_tokens],
            block_table=common.block_table[:n],
            seq_lens=common.seq_lens[:n],
            query_start_loc=common.query_start_loc[: n + 1],
            tile_req=None,
            tile_q0=None,
            num_tiles=n,
            num_tokens=common.num_actual_tokens,
            kernel=kernel,
        )
        # Decode tiles (tile i is request i) take every request to own one token: token i. A
        # request with none (max_query_len 1 allows it) goes through the tiles instead.
        if (common.max_query_len == 1 and kernel.block_q == 1
                and common.num_actual_tokens == n):
            programs = n * spec.num_kv_heads * kernel.num_splits
            # (Not measured for fp8 caches, whose decode kernel was tuned to its registers.)
            if (self.longest_first and programs > 2 * self.num_sms
                    and spec.kv_cache_dtype.itemsize > 1):
                metadata.order = self._longest_first(metadata.seq_lens, common.cuda_graph)
            return metadata
        qsl = common.query_start_loc_cpu[: n + 1].numpy()
        q_lens = qsl[1:] - qsl[:-1]
        if self.decodes_apart and not common.cuda_graph:
            q_lens = self._split_off_decodes(metadata, common, q_lens)
        key = (n, common.max_query_len, kernel.block_q)
        if common.cuda_graph and key in self._graph_tiles:
            tiles, num_tiles = self._graph_tiles[key]
        else:
            tiles, num_tiles = self._tiles(q_lens, kernel.block_q)
            if common.cuda_graph:
                if (q_lens != common.max_query_len).any():
                    raise ValueError("a CUDA-graph batch must have the same number of new "
                                     f"tokens in every request; got {q_lens.tolist()}")
                self._graph_tiles[key] = tiles, num_tiles
        metadata.tile_req, metadata.tile_q0 = tiles[0], tiles[1]
        metadata.num_tiles = num_tiles
        return metadata

    def _split_off_decodes(self, metadata: TritonAttentionMetadata,
                           common: CommonAttentionMetadata, q_lens: np.ndarray) -> np.ndarray:
        """Give the step's one-token requests a decode launch of their own (``decode_reqs``,
        ``decode_kernel``) when they are enough to fill two waves of SMs unsplit, the cache is
        bf16/fp16 and the prompt tiles are unsplit; returns the query lengths the prompt tiles
        are cut from (the split-off requests' as 0)."""
        spec = self.spec
        decoding = np.flatnonzero(q_lens == 1)
        if (metadata.kernel.block_q == 1 or metadata.kernel.num_splits != 1
                or spec.kv_cache_dtype.itemsize == 1
                or 2 * len(decoding) * spec.num_kv_heads <= 4 * self.num_sms):
            return q_lens
        seq_lens = common.seq_lens_cpu[: common.num_reqs].numpy()[decoding]
        kernel = choose_kernel_config(
            num_reqs=len(decoding), max_query_len=1,
            max_seq_len=self._graph_max_seq_len or int(seq_lens.max()),
            num_kv_heads=spec.num_kv_heads, group=spec.num_heads // spec.num_kv_heads,
            head_size=spec.head_size, num_sms=self.num_sms, on_gpu=self.device.type == "cuda",
            kv_bytes=spec.kv_cache_dtype.itemsize)
        if kernel.num_splits != 1:
            return q_lens
        order = decoding[np.argsort(-seq_lens, kind="stable")].astype(np.int64)
        host = torch.from_numpy(order)
        if self.device.type == "cuda":
            host = host.pin_memory()
        metadata.decode_reqs = host.to(self.device, non_blocking=True)
        metadata.decode_kernel = kernel
        rest = q_lens.copy()
        rest[decoding] = 0
        return rest

    def _longest_first(self, seq_lens: torch.Tensor, cuda_graph: bool) -> torch.Tensor:
        """The request indices by descending ``seq_lens``, sorted on the device (no host
        copy to wait for); into buffers kept per batch size for CUDA-graph batches."""
        if not cuda_graph:
            return torch.sort(seq_lens, descending=True, stable=True).indices
        n = seq_lens.shape[0]
        buffers = self._graph_order.get(n)
        if buffers is None:
            buffers = (torch.empty_like(seq_lens),
                       torch.empty(n, dtype=torch.int64, device=self.device))
            self._graph_order[n] = buffers
        torch.sort(seq_lens, descending=True, stable=True, out=buffers)
        return buffers[1]

    def _tiles(self, q_lens: np.ndarray, block_q: int) -> tuple[torch.Tensor, int]:
        """The request and first query index of every query tile ([2, num_tiles] on the
        device) and the number of tiles."""
        tiles = -(-q_lens // block_q)
        tile_req = np.repeat(np.arange(len(q_lens), dtype=np.int32), tiles)
        first_tile = np.cumsum(tiles) - tiles
        tile_q0 = ((np.arange(len(tile_req)) - first_tile[tile_req]) * block_q)
        # Rows padded to 16 bytes: the second starts as aligned as the first whatever the
        # count. Triton specializes a pointer on its alignment, so an unaligned tile_q0 would
        # be a kernel variant of its own, compiled on the first step that has one.
        table = np.zeros((2, -(-len(tile_req) // 4) * 4), dtype=np.int32)
        table[0, : len(tile_req)] = tile_req
        table[1, : len(tile_req)] = tile_q0
        tiles_host = torch.from_numpy(table)
        if self.device.type == "cuda":
            tiles_host = tiles_host.pin_memory()
        return tiles_host.to(self.device, non_blocking=True), len(tile_req)


class TritonAttentionImpl(AttentionImpl):
    """Writes K/V with ``write_kv_cache``, then runs ``paged_attention`` (and ``merge_splits``
    when the context is split).

    An fp8 cache is written as ``K / k_scale`` and read with ``k_scale`` / ``v_scale`` inside
    the kernels: the scales are device tensors read by the kernels, so a CUDA graph replays
    whatever values they hold. Scales not bound by a layer (direct use) mean 1.0.
    """

    _unit_scale: torch.Tensor | None = None

    def _scales(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k_scale is not None and self.v_scale is not None:
            return self.k_scale, self.v_scale
        if self._unit_scale is None or self._unit_scale.device != device:
            self._unit_scale = torch.ones((), dtype=torch.float32, device=device)
        return (self.k_scale if self.k_scale is not None else self._unit_scale,
                self.v_scale if self.v_scale is not None else self._unit_scale)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
    ) -> torch.Tensor:
        from hitchllm.attention.dependent_launch import dependent_launch, launch_options
        from hitchllm_attention_triton import kernels

        num_tokens = metadata.num_tokens
        key_cache, value_cache = kv_cache.unbind(0)
        token_size = self.num_kv_heads * self.head_size
        key = key[:num_tokens].reshape(num_tokens, token_size)
        value = value[:num_tokens].reshape(num_tokens, token_size)
        fp8 = FP8_FORMATS.get(kv_cache.dtype)
        # Unused by the kernels when the cache is not fp8: any tensor will do.
        k_scale, v_scale = self._scales(query.device) if fp8 else (query, query)
        pdl = dependent_launch(query)
        if num_tokens:
            fmt = {} if fp8 is None else dict(zip(("FP8_MAX", "MANT_BITS", "MIN_EXP"), fp8))
            kernels.write_kv_cache[(num_tokens,)](
                key, value, kv_cache, metadata.slot_mapping, k_scale, v_scale,
                key.stride(0), value.stride(0), kv_cache.stride(0),
                TOKEN_SIZE=token_size, TOKEN_PAD=triton_next_pow2(token_size), **fmt,
                PDL=pdl, **launch_options(pdl),
            )
        out = torch.empty_like(query)
        if num_tokens == 0:
            return out
        cfg = metadata.kernel
        head_pad = max(16, triton_next_pow2(self.head_size))
        splits = cfg.num_splits
        if splits > 1:
            partial = torch.empty(splits * num_tokens * self.num_heads * head_pad,
                                  dtype=torch.float32, device=query.device)
            lse = torch.empty(splits * num_tokens * self.num_heads, dtype=torch.float32,
                              device=query.device)
        else:
            partial = lse = out  # unused
        v_word = cfg.v_word if fp8 else 1
        if v_word > 1:  # fp8 V read as words of v_word values (see kernels.py)
            value_cache = value_cache.view(V_WORD_DTYPES[v_word])

        def attend(cfg: KernelConfig, grid: tuple[int, int, int], tile_req: torch.Tensor,
                   tile_q0: torch.Tensor, decode: bool, longest_first: bool) -> None:
            kernels.paged_attention[grid](
                out, query, key_cache, value_cache,
                metadata.block_table, metadata.seq_lens, metadata.query_start_loc,
                tile_req, tile_q0, partial, lse, k_scale, v_scale,
                self.scale * 1.4426950408889634, self.spec.logits_soft_cap or 0.0,
                query.stride(0), query.stride(1), out.stride(0), out.stride(1),
                key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
                metadata.block_table.stride(0),
                num_tokens, self.num_heads,
                GROUP=self.num_heads // self.num_kv_heads, HEAD_DIM=self.head_size,
                HEAD_PAD=head_pad, BLOCK_Q=cfg.block_q, BLOCK_M=cfg.block_m,
                BLOCK_N=cfg.block_n, PAGE=key_cache.shape[1],
                USE_SOFTCAP=self.spec.logits_soft_cap is not None,
                WINDOW=self.spec.sliding_window or 0, NUM_SPLITS=cfg.num_splits,
                DECODE=decode, FP8=fp8 is not None, V_WORD=v_word,
                # Inline PTX unpacks fp8 words on NVIDIA GPUs; Triton's casts elsewhere.
                ASM_CVT=v_word > 1 and query.device.type == "cuda" and torch.version.hip is None,
                LONGEST_FIRST=longest_first, PDL=pdl,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(pdl),
            )

        if metadata.decode_reqs is not None:  # a prompt step's decodes, apart (bf16/fp16)
            attend(metadata.decode_kernel,
                   (metadata.decode_reqs.shape[0] * self.num_kv_heads, 1, 1),
                   metadata.decode_reqs, metadata.seq_lens, decode=True, longest_first=True)
        if metadata.tile_req is None:  # a decode batch: tile i is request i
            if metadata.order is not None:
                attend(cfg, (metadata.num_tiles * self.num_kv_heads, 1, splits), metadata.order,
                       metadata.seq_lens, decode=True, longest_first=True)
            else:
                attend(cfg, (metadata.num_tiles, self.num_kv_heads, splits), metadata.seq_lens,
                       metadata.seq_lens, decode=True, longest_first=False)
        else:
            attend(cfg, (metadata.num_tiles, self.num_kv_heads, splits), metadata.tile_req,
                   metadata.tile_q0, decode=False, longest_first=False)
        if splits > 1:
            kernels.merge_splits[(num_tokens, self.num_heads)](
                out, partial, lse, out.stride(0), out.stride(1), num_tokens, self.num_heads,
                HEAD_DIM=self.head_size, HEAD_PAD=head_pad, NUM_SPLITS=splits,
                SPLITS_PAD=max(2, triton_next_pow2(splits)), PDL=pdl, **launch_options(pdl),
            )
        return out


def triton_next_pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


class TritonAttentionBackend(AttentionBackend):
    """Paged attention in Triton: prefill, chunked prefill and decode in one kernel family,
    GQA/MQA, split-KV decoding, sliding window, logits soft-cap, and fp8 KV caches (e4m3 and
    e5m2, per-layer scales) read and dequantized in registers."""

    name: ClassVar[str] = "TRITON_ATTN"
    priority: ClassVar[int] = 100
    cuda_graph_support: ClassVar[CudaGraphSupport] = CudaGraphSupport.UNIFORM_BATCH
    reads_batch_on_device: ClassVar[bool] = True
    # Decode tiles eagerly, the short-query tiles of every length that picks them, and the
    # prompt tiles every longer query takes (the token count is not specialized).
    warm_up_query_lens: ClassVar[tuple[int, ...]] = tuple(range(1, SHORT_QUERY + 2))

    @classmethod
    def validate(cls, spec: AttentionSpec) -> list[str]:
        reasons = triton_device_reasons(spec)
        if reasons and importlib.util.find_spec("triton") is None:
            return reasons
        if spec.use_mla:
            reasons.append("MLA models need an MLA backend (TRITON_MLA, from "
                           "hitchllm-attention-mla)")
        if spec.kv_cache_dtype in FP8_DTYPES:
            capability = spec.device_capability
            if spec.device_type == "cuda" and capability is not None and capability < (8, 9):
                reasons.append(f"an fp8 KV cache needs compute capability 8.9 or newer (Ada, "
                               f"Hopper) for Triton's fp8 types; this GPU is {capability} "
                               "(use kv_cache_dtype=auto)")
        elif spec.kv_cache_dtype != spec.dtype:
            reasons.append("a KV-cache dtype different from the model dtype is not supported")
        if spec.head_size > MAX_HEAD_SIZE:
            reasons.append(f"head size {spec.head_size} is above {MAX_HEAD_SIZE}")
        if spec.num_heads % spec.num_kv_heads:
            reasons.append(f"{spec.num_heads} query heads are not a multiple of "
                           f"{spec.num_kv_heads} KV heads")
        return reasons

    @classmethod
    def get_kv_cache_shape(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        return TritonAttentionImpl

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        return TritonAttentionMetadataBuilder
