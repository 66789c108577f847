"""The MLA attention layer models call, and the interface every MLA backend's impl implements.

Multi-head latent attention (DeepSeek-V2/V3) caches, per token, one vector shared by every
head: the normalized compressed KV ``c_kv`` (``kv_lora_rank`` values) followed by the rotated
rotary part of the key ``k_pe`` (``qk_rope_head_dim`` values). Per-head keys and values are
up-projections of ``c_kv`` through ``kv_b_proj`` ([heads * (qk_nope + v), kv_lora_rank]):

    k_nope[h] = W_UK[h] @ c_kv        v[h] = W_UV[h] @ c_kv
    score[h]  = q_nope[h] . k_nope[h] + q_pe[h] . k_pe

Two equivalent ways to attend, which a backend chooses per request:

- expanded (prefill, long chunks): up-project the whole context to per-head K/V and run
  ordinary causal attention with head size ``qk_nope + qk_rope``;
- absorbed (decode): fold ``W_UK`` into the query (``q_lat[h] = W_UK[h]^T q_nope[h]``), attend
  over the latent cache directly (``score = q_lat . c_kv + q_pe . k_pe``, output in latent
  space ``o_lat = sum p * c_kv``), then apply ``W_UV`` (``out[h] = W_UV[h] @ o_lat[h]``): each
  token's latent is read once for all heads.

The interface between layer and impl:

1. The engine builds the impl as for any layer: ``impl_cls(num_heads, head_size, scale,
   num_kv_heads, spec)``, where ``head_size`` is the latent width and ``num_kv_heads`` 1.
2. ``MLAAttention.bind`` (called by the engine with the impl and the cache tensor) hands the
   impl the layer's ``MLADims`` and its ``kv_b_proj`` module with ``MLAAttentionImpl.attach``;
   the impl reads ``W_UK`` / ``W_UV`` from the module's weight as views, so weights loaded or
   updated in place are seen.
3. ``MLAAttention.forward(q_nope, q_pe, kv_c_normed, k_pe)`` calls
   ``impl.forward(query, latent, None, kv_cache, metadata)`` with ``query`` the heads' full
   queries ``[T, heads, qk_nope + qk_rope]`` (rope part rotated) and ``latent`` the new tokens'
   cache vectors ``[T, 1, kv_lora_rank + qk_rope]``; the impl writes ``latent`` through the slot
   mapping and returns ``[T, heads, v_head_dim]``.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from hitchllm.attention import Attention, AttentionImpl, KVCacheSpec, get_forward_context
from hitchllm.layers import LinearBase, UnquantizedLinearMethod


@dataclass(frozen=True)
class MLADims:
    """The shapes of one MLA layer (this rank's heads)."""

    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def latent_width(self) -> int:
        """Values cached per token: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class MLAAttentionImpl(AttentionImpl):
    """Runs one MLA layer with one kernel family. ``attach`` must run before ``forward``
    (``MLAAttention.bind`` does it)."""

    dims: MLADims
    kv_b_proj: LinearBase

    def attach(self, dims: MLADims, kv_b_proj: LinearBase) -> None:
        """Give the impl the layer's shapes and its up-projection. Raises ``ValueError`` when
        ``kv_b_proj`` applies anything but its plain weight (quantization, a LoRA wrapper):
        decode absorbs that weight as a dense matrix, which would silently drop the rest."""
        if type(kv_b_proj.linear_method) is not UnquantizedLinearMethod:
            raise ValueError(
                f"{type(self).__name__} absorbs kv_b_proj's weight into the decode query, which "
                f"needs a plain kv_b_proj ({kv_b_proj.prefix} uses "
                f"{type(kv_b_proj.linear_method).__name__}); exclude kv_b_proj from "
                "quantization and from LoRA target modules")
        self.dims = dims
        self.kv_b_proj = kv_b_proj

    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W_UK [heads, qk_nope, rank], W_UV [heads, v, rank])``: views of ``kv_b_proj``."""
        d = self.dims
        w = self.kv_b_proj.weight.view(d.num_heads, d.qk_nope_head_dim + d.v_head_dim,
                                       d.kv_lora_rank)
        return w[:, : d.qk_nope_head_dim], w[:, d.qk_nope_head_dim:]

    def expand(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys ``[S, heads, qk_nope + qk_rope]`` and values ``[S, heads, v]`` of
        ``S`` cached tokens (``c_kv`` [S, rank], ``k_pe`` [S, qk_rope])."""
        d = self.dims
        kv = self.kv_b_proj(c_kv).view(-1, d.num_heads, d.qk_nope_head_dim + d.v_head_dim)
        k_nope, v = kv.split([d.qk_nope_head_dim, d.v_head_dim], dim=-1)
        k_rope = k_pe[:, None, :].expand(-1, d.num_heads, -1)
        return torch.cat((k_nope, k_rope), dim=-1), v

    @abstractmethod
    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None,
        kv_cache: torch.Tensor, metadata: Any,
    ) -> torch.Tensor:
        """Write ``key`` (the new latents, [T, 1, kv_lora_rank + qk_rope]) into ``kv_cache``
        through the slot mapping, then attend ``query`` ([T, heads, qk_nope + qk_rope]) over
        each request's cached context, causally. ``value`` is None: the latent is both key and
        value. Returns [T, heads, v_head_dim]."""


class MLAAttention(Attention):
    """Paged multi-head latent attention over the engine's latent KV cache.

    ``forward(q_nope, q_pe, kv_c_normed, k_pe)`` takes the new tokens' query parts
    ([T, heads, qk_nope], [T, heads, qk_rope], rope applied), normalized compressed KV
    ([T, kv_lora_rank]) and rotated key rope part ([T, qk_rope]), and returns the attention
    output [T, heads * v_head_dim], before ``o_proj``. ``kv_b_proj`` is the layer's
    up-projection, owned by the model's attention module and shared with the impl.
    """

    def __init__(self, dims: MLADims, scale: float, layer_index: int, kv_b_proj: LinearBase
                 ) -> None:
        super().__init__(dims.num_heads, dims.latent_width, 1, scale, layer_index)
        self.dims = dims
        # Not a submodule: the model's attention module owns it (and its checkpoint name).
        self._kv_b_proj = [kv_b_proj]

    def get_kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return KVCacheSpec.for_mla(self.dims.kv_lora_rank, self.dims.qk_rope_head_dim, dtype,
                                   block_size)

    def bind(self, impl: AttentionImpl | None, kv_cache: torch.Tensor | None) -> None:
        if impl is not None and not isinstance(impl, MLAAttentionImpl):
            raise ValueError(f"MLA layer {self.layer_index} needs an MLA attention backend, got "
                             f"{type(impl).__name__}")
        if isinstance(impl, MLAAttentionImpl):
            impl.attach(self.dims, self._kv_b_proj[0])
        super().bind(impl, kv_cache)

    def forward(  # type: ignore[override]
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
    ) -> torch.Tensor:
        if self.impl is None or self.kv_cache is None:
            raise RuntimeError(f"MLA layer {self.layer_index} has no backend bound; build the "
                               "model through hitchllm's engine")
        query = torch.cat((q_nope, q_pe), dim=-1)
        latent = torch.cat((kv_c_normed, k_pe), dim=-1)[:, None, :]
        out = self.impl.forward(query, latent, None, self.kv_cache,
                                get_forward_context().attn_metadata)
        return out.reshape(-1, self.dims.num_heads * self.dims.v_head_dim)

