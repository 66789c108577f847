"""TRITON_MLA: a Triton paged MLA decode kernel (split-KV), with TORCH_MLA's prefill path.

Decode runs in the absorbed form: the query's no-rope part is folded through ``W_UK`` into
latent space on the host side of the kernel (one batched matmul), the kernel attends over the
paged latent cache reading each token's latent once for a block of heads, and ``W_UV`` maps
the latent output back to per-head values. Long contexts are split over several programs per
request ("split-KV"); each writes its partial output with its running maximum and sum, and a
second kernel merges the partials (one program per head and 128 output columns). Requests
with several new tokens (prompts, chunks) run TORCH_MLA's expanded path (SDPA).

CUDA graphs (``CudaGraphSupport.UNIFORM_DECODE``): a batch of decodes only gets
``TritonMLADecodeMetadata``, views of the engine's persistent buffers (sequence lengths,
block table, slot mapping), and its impl path reads nothing back to the host, allocates only
through ``torch.empty``/``new_zeros`` and launches a grid fixed by the batch size and
``max_seq_len`` (the engine's ``max_model_len`` for graph batches). Mixed batches stay eager.

The cache layout is TORCH_MLA's: ``[num_blocks + 1, block_size, kv_lora_rank + rope]``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import math
import re
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from hitchllm.attention import (
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionSpec,
    CommonAttentionMetadata,
    CudaGraphSupport,
)
from hitchllm.attention.torch_backend import (
    BatchedRequests,
    TorchAttentionMetadata,
    TorchAttentionMetadataBuilder,
)
from hitchllm.attention.triton_support import triton_device_reasons
from hitchllm_attention_mla.ranking import MLA_BACKEND_PRIORITY
from hitchllm_attention_mla.torch_mla import TorchMLABackend, TorchMLAImpl, mla_reasons

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MLADecodeTiles:
    """How the decode kernel tiles the work: heads per program (``block_h``), tokens per
    iteration (``block_n``), latent-output columns per program (``block_o``; the programs of
    one head block split the output, each recomputing the scores), Triton's warps and
    pipeline stages, and the programs a step should launch before long contexts are split
    further (``target_programs``)."""

    block_h: int = 16
    block_n: int = 16
    block_o: int = 512
    num_warps: int = 4
    num_stages: int = 2
    target_programs: int = 128
    #: "triton" (``triton_mla_kernel``, any GPU and the interpreter) or "gluon_sm90"
    #: (``gluon_mla_kernel``: Hopper only, at its fixed tiles and DeepSeek's 512 + 64 dims).
    kernel: Literal["triton", "gluon_sm90"] = "triton"


#: Tiles for Triton's CPU interpreter (tests): small blocks run fastest there.
DEFAULT_TILES = MLADecodeTiles()

#: Tiles for GPUs with at least ``LARGE_SMEM_BYTES`` of shared memory per block (H100: 227
#: KiB), the best of a sweep at DeepSeek-V3 dims on an H100 (64 x 2048 and 1 x 32k, pages of
#: 16 and 64): 64 heads per program (the query block, 64 x 576, sits in shared memory), 64-token
#: latent tiles loaded two deep (the next tile's copy overlaps this one's dots: 224 -> 188 us
#: at 64 x 2048), the whole 512-wide output per program. Compiled for sm_90 it takes 216 KiB
#: of shared memory and 255 registers a thread; 32- and 16-token tiles, deeper pipelines and
#: more splits were slower (RESULTS.md, "MLA decode").
LARGE_SMEM_TILES = MLADecodeTiles(block_h=64, block_n=64, block_o=512, num_warps=8,
                                  num_stages=2)
LARGE_SMEM_BYTES = 216 * 1024
#: Other GPUs (A100: 163 KiB): a 16-head query block.
SMALL_SMEM_TILES = MLADecodeTiles(block_h=16, block_n=32, block_o=512, num_warps=4,
                                  num_stages=2)
#: Hopper (sm_90) at DeepSeek's latent dims: the Gluon kernel (its docstring says why),
#: selected with the tiles of LARGE_SMEM_TILES (the Triton kernel runs them where the Gluon
#: kernel cannot build); it cuts splits at ``block_n`` tokens like the Triton kernel and runs
#: two warpgroups over 32-token tiles inside them.
HOPPER_TILES = dataclasses.replace(LARGE_SMEM_TILES, kernel="gluon_sm90")


@functools.cache
def tiles_for(device: torch.device) -> MLADecodeTiles:
    """The decode tiles for ``device``; on a GPU one program per SM before splitting."""
    if device.type != "cuda":
        return DEFAULT_TILES
    props = torch.cuda.get_device_properties(device)
    smem = getattr(props, "shared_memory_per_block_optin", 0)
    tiles = LARGE_SMEM_TILES if smem >= LARGE_SMEM_BYTES else SMALL_SMEM_TILES
    if (props.major, props.minor) == (9, 0) and gluon_supported(_triton_version()):
        tiles = HOPPER_TILES
    return dataclasses.replace(tiles, target_programs=props.multi_processor_count)


#: The oldest Triton whose Gluon the Hopper kernel is written for (its API changes between
#: releases; tested on 3.6 on an H100 and compiled with 3.7).
GLUON_MIN_TRITON = (3, 6)


def gluon_supported(triton_version: str | None) -> bool:
    """Whether a Triton of ``triton_version`` ("3.6.0"; None: not installed) has the Gluon
    the Hopper kernel needs."""
    match = re.match(r"(\d+)\.(\d+)", triton_version or "")
    return match is not None and (int(match[1]), int(match[2])) >= GLUON_MIN_TRITON


def _triton_version() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return None
    import triton

    return triton.__version__


@functools.cache
def _gluon_module():
    """The Hopper kernel's module, or None (with a warning) where this Triton's Gluon lacks a
    name it uses."""
    try:
        from hitchllm_attention_mla import gluon_mla_kernel
    except (ImportError, AttributeError) as exc:
        logger.warning("TRITON_MLA: the Hopper decode kernel needs another Triton (%s); using "
                       "the Triton kernel", exc)
        return None
    return gluon_mla_kernel


# The specializations (lengths dtype, page size) the Hopper kernel failed to build or load
# for here (a Triton whose Gluon differs from the one it was written for): those calls run the
# Triton kernel from then on.
_gluon_failed: set[tuple[torch.dtype, int]] = set()


def hopper_kernel_fallbacks() -> set[tuple[torch.dtype, int]]:
    """The (lengths dtype, page size) specializations whose calls fell back from the Hopper
    kernel to the Triton kernel in this process (empty when none did)."""
    return set(_gluon_failed)


def _on_hopper(q: torch.Tensor) -> bool:
    return q.is_cuda and _is_hopper(q.device)


@functools.cache
def _is_hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) == (9, 0)


def _gluon_takes(q: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor,
                 kv_lora_rank: int, tiles: MLADecodeTiles) -> bool:
    """Whether the Hopper kernel fits this call (else the Triton kernel runs): an sm_90 GPU,
    its fixed tiles, DeepSeek's latent, bf16 queries and cache (the dtype it was tested in), and
    a specialization that has not failed here."""
    if tiles.kernel != "gluon_sm90" or (seq_lens.dtype, kv_cache.shape[1]) in _gluon_failed:
        return False
    g = _gluon_module()
    return (g is not None and _on_hopper(q) and kv_lora_rank == 512
            and q.shape[-1] - kv_lora_rank == g.ROPE
            and q.dtype == torch.bfloat16 and kv_cache.dtype == q.dtype
            and (tiles.block_h, tiles.block_n, tiles.num_warps) == (g.BLOCK_H, g.BLOCK_N,
                                                                    g.NUM_WARPS))


#: Latent columns per program of the split merge.
MERGE_BLOCK_O = 128


def _next_pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, scale: float, kv_lora_rank: int, max_seq_len: int,
               num_splits: int | None = None, tiles: MLADecodeTiles | None = None
               ) -> torch.Tensor:
    """Absorbed MLA decode: ``q`` [N, heads, latent] (``W_UK``-absorbed no-rope part, then
    the rope part) of N one-token requests over their ``seq_lens`` cached latents
    (``kv_cache`` [blocks, block_size, latent], ``block_table`` [N, cols]). Returns the
    latent-space output [N, heads, kv_lora_rank] in ``q``'s dtype: ``softmax(scale * q .
    latent)`` weighted sum of the latents' first ``kv_lora_rank`` values; zeros for a request
    with an empty context (a padding row of a CUDA-graph batch). ``max_seq_len`` (an upper
    bound will do) and N choose the number of splits; the kernel cuts each context itself.
    ``tiles`` defaults to ``tiles_for(q.device)``."""
    from hitchllm_attention_mla.triton_mla_kernel import mla_decode_partials, mla_merge_splits

    tiles = tiles or tiles_for(q.device)

    n, heads, width = q.shape
    block_l = _next_pow2(kv_lora_rank)
    block_o = min(tiles.block_o, block_l)
    head_blocks = -(-heads // tiles.block_h)
    if num_splits is None:
        num_splits = decode_splits(n, heads, max_seq_len, tiles)
    # One split: the kernel stores the normalized output in the model dtype, nothing to merge.
    acc = torch.empty(n, heads, num_splits, kv_lora_rank, device=q.device,
                      dtype=q.dtype if num_splits == 1 else torch.float32)
    stats = torch.empty(2, n, heads, num_splits, dtype=torch.float32, device=q.device)
    args = (q, kv_cache, block_table, seq_lens, acc, stats, scale * math.log2(math.e),
            q.stride(0), q.stride(1), block_table.stride(0), acc.stride(0), acc.stride(1),
            acc.stride(2), stats.stride(0), stats.stride(1), stats.stride(2), heads)
    dims = {"KV_LORA_RANK": kv_lora_rank, "WIDTH": width, "PAGE": kv_cache.shape[1],
            "BLOCK_H": tiles.block_h, "BLOCK_N": tiles.block_n}
    if not (_gluon_takes(q, kv_cache, seq_lens, kv_lora_rank, tiles)
            and _launch_gluon((head_blocks, num_splits, n), args, dims)):
        mla_decode_partials[(head_blocks * (block_l // block_o), num_splits, n)](
            *args, **dims, BLOCK_L=block_l, BLOCK_R=_next_pow2(width - kv_lora_rank),
            BLOCK_O=block_o, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    if num_splits == 1:
        return acc[:, :, 0]
    out = q.new_empty(n, heads, kv_lora_rank)
    merge_o = min(MERGE_BLOCK_O, block_l)
    mla_merge_splits[(n, heads, block_l // merge_o)](
        acc, stats, out, acc.stride(0), acc.stride(1), acc.stride(2), stats.stride(0),
        stats.stride(1), stats.stride(2), out.stride(0), out.stride(1), num_splits,
        kv_lora_rank, BLOCK_S=_next_pow2(num_splits), BLOCK_O=merge_o)
    return out


def _launch_gluon(grid: tuple[int, int, int], args: tuple, dims: dict[str, int]) -> bool:
    """Launch the Hopper kernel; False (and a warning) when this Triton cannot build or load
    it for this specialization (a compile, ptxas or MLIR pass error, or too many resources),
    so the caller runs the Triton kernel instead. Those errors come before the launch, so a
    CUDA-graph capture in progress records only the fallback."""
    from triton.errors import TritonError

    try:
        g = _gluon_module()
        g.mla_decode_partials_sm90[grid](*args, **dims, num_warps=g.LAUNCH_WARPS)
    except (TritonError, RuntimeError) as exc:
        lengths, page = args[3].dtype, dims["PAGE"]
        _gluon_failed.add((lengths, page))
        logger.warning("TRITON_MLA: the Hopper decode kernel failed for %s lengths and pages of "
                       "%d with this Triton (%s: %s); using the Triton kernel",
                       lengths, page, type(exc).__name__, str(exc).splitlines()[-1][:200])
        return False
    return True


def decode_splits(num_reqs: int, heads: int, max_seq_len: int,
                  tiles: MLADecodeTiles = DEFAULT_TILES) -> int:
    """Splits per request: enough programs for about ``tiles.target_programs`` per step, no
    more than ``max_seq_len`` has tiles of ``block_n`` tokens. Host values only (batch shape
    and the length bound), so a graph batch's launch is fixed by its padded size."""
    programs = max(1, num_reqs * -(-heads // tiles.block_h))
    return max(1, min(tiles.target_programs // programs, -(-max_seq_len // tiles.block_n)))


@dataclass
class TritonMLADecodeMetadata:
    """A batch of decodes only: request ``i``'s one new token is token ``i``. Every tensor is
    a view of the engine's buffers (persistent for CUDA-graph batches, which count padding
    requests with context 0 and slot -1 in ``num_reqs``)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    num_reqs: int
    max_seq_len: int  # an upper bound for graph batches (max_model_len)


class TritonMLAMetadataBuilder(TorchAttentionMetadataBuilder):
    """Decode-only batches (every request one new token, CUDA-graph batches among them) as
    views of the engine's buffers; other batches as TORCH_MLA splits them (eager only)."""

    def build(self, common: CommonAttentionMetadata
              ) -> TritonMLADecodeMetadata | TorchAttentionMetadata:
        if common.max_query_len != 1:
            if common.cuda_graph:
                raise ValueError("TRITON_MLA captures only uniform decode batches (one new "
                                 f"token per request); got max_query_len "
                                 f"{common.max_query_len} in a CUDA-graph batch")
            metadata = super().build(common)
            if metadata.batched is not None:
                # int32 like a decode batch's, so the decode kernel's launch shares a decode
                # batch's specialization (int64 would build another, seconds on a GPU host).
                metadata.batched.seq_lens = metadata.batched.seq_lens.int()
            return metadata
        n = common.num_reqs
        return TritonMLADecodeMetadata(
            slot_mapping=common.slot_mapping[: common.num_actual_tokens],
            block_table=common.block_table[:n], seq_lens=common.seq_lens[:n], num_reqs=n,
            max_seq_len=common.max_seq_len)


class TritonMLAImpl(TorchMLAImpl):
    """TORCH_MLA with the decodes in Triton: a decode-only batch (graph-safe) as a whole, the
    decodes of a mixed batch (the batched requests, one new token each) among its prefills."""

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None,
        kv_cache: torch.Tensor, metadata: TritonMLADecodeMetadata | TorchAttentionMetadata,
    ) -> torch.Tensor:
        if not isinstance(metadata, TritonMLADecodeMetadata):
            return super().forward(query, key, value, kv_cache, metadata)
        self.write_latents(kv_cache, key[:, 0], metadata.slot_mapping)
        n = metadata.num_reqs
        out = self._decode(query[:n], kv_cache, metadata.block_table, metadata.seq_lens,
                           metadata.max_seq_len)
        if query.shape[0] == n:
            return out
        padded = query.new_zeros(query.shape[0], *out.shape[1:])
        padded[:n] = out
        return padded

    def _attend_absorbed(self, query: torch.Tensor, kv_cache: torch.Tensor, b: BatchedRequests
                         ) -> torch.Tensor:
        # The builder batches only requests with one new token (MLA has no soft-cap), so the
        # batched tokens are the requests, in order.
        return self._decode(query, kv_cache, b.block_table, b.seq_lens, b.max_seq_len)

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                seq_lens: torch.Tensor, max_seq_len: int) -> torch.Tensor:
        """Request ``i``'s one token ``query[i]`` over its ``seq_lens[i]`` cached latents, in
        the absorbed form: [N, heads, v_head_dim]."""
        d = self.dims
        w_uk, w_uv = self.up_weights()
        q_nope, q_pe = query.split([d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)
        q = torch.cat((torch.einsum("thd,hdr->thr", q_nope, w_uk), q_pe), dim=-1).contiguous()
        o_lat = mla_decode(q, kv_cache, block_table, seq_lens, self.scale, d.kv_lora_rank,
                           max_seq_len)
        return torch.einsum("thr,hvr->thv", o_lat, w_uv)


class TritonMLABackend(TorchMLABackend):
    """Paged MLA with a Triton decode kernel; NVIDIA GPUs (sm_80+), or Triton's CPU
    interpreter for tests."""

    name: ClassVar[str] = "TRITON_MLA"
    priority: ClassVar[int] = MLA_BACKEND_PRIORITY["TRITON_MLA"]
    cuda_graph_support: ClassVar[CudaGraphSupport] = CudaGraphSupport.UNIFORM_DECODE
    # A decode batch run eagerly, and the decodes of a mixed batch beside its prompts.
    warm_up_query_lens: ClassVar[tuple[int, ...]] = (1, 2)

    @classmethod
    def validate(cls, spec: AttentionSpec) -> list[str]:
        device_reasons = triton_device_reasons(spec)
        if importlib.util.find_spec("triton") is None:
            return device_reasons
        return mla_reasons(spec, cls.name) + device_reasons

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        return TritonMLAImpl

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        return TritonMLAMetadataBuilder
