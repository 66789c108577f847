"""The ``Attention`` layer models call; which kernel runs is decided by the engine."""

from __future__ import annotations

import torch
from torch import nn

from hitchllm.attention.backend import AttentionImpl
from hitchllm.attention.forward_context import current_split_attention, get_forward_context
from hitchllm.attention.kv_cache_spec import KVCacheSpec
from hitchllm.layers.method import ShardId, set_weight_attrs

#: Checkpoint names of a layer's fp8 KV-cache scales, relative to the checkpoint's attention
#: module (``model.layers.0.self_attn``) -> the ``Attention`` parameter they load into:
#: llm-compressor / compressed-tensors ``kv_cache_scheme`` and fp8 checkpoints store
#: ``k_scale`` / ``v_scale``; older fp8 checkpoints the outputs' scales of k_proj / v_proj.
KV_SCALE_CHECKPOINT_NAMES = {
    "k_scale": "k_scale",
    "v_scale": "v_scale",
    "k_proj.output_scale": "k_scale",
    "v_proj.output_scale": "v_scale",
}


def kv_scale_target(name: str, attention_module: str, attention_layer: str) -> str | None:
    """The parameter name a checkpoint KV-cache scale ``name`` loads into, or None when
    ``name`` is not one. ``attention_module`` is the checkpoint's name of a layer's
    attention module (``"self_attn"``), ``attention_layer`` the model's attribute holding its
    ``Attention`` (``"attn"``): ``model.layers.0.self_attn.k_proj.output_scale`` ->
    ``model.layers.0.self_attn.attn.k_scale``."""
    for suffix, param in KV_SCALE_CHECKPOINT_NAMES.items():
        tail = f".{attention_module}.{suffix}"
        if name.endswith(tail):
            return f"{name[: -len(tail)]}.{attention_module}.{attention_layer}.{param}"
    return None


def load_kv_scale(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
    """Copy a checkpoint's per-tensor KV-cache scale (one positive finite value, shaped
    ``[]`` or ``[1]``) into ``param`` and mark it as loaded."""
    if shard_id is not None:
        raise ValueError(f"a KV-cache scale has no stacked slots, got shard {shard_id!r}")
    if loaded.numel() != 1:
        raise ValueError(
            f"shape {tuple(loaded.shape)} is not a per-tensor KV-cache scale (one value, shape "
            "[] or [1]); per-head or per-channel KV-cache scales are not supported")
    value = loaded.reshape(()).float()
    if not bool(torch.isfinite(value)) or float(value) <= 0:
        raise ValueError(f"KV-cache scale {float(value)} is not a positive finite number")
    with torch.no_grad():
        param.copy_(value)
    param.from_checkpoint = True


class Attention(nn.Module):
    """Paged attention over the engine's KV cache: ``out = attn(q, k, v)``.

    ``q`` is [num_tokens, num_heads * head_size]; ``k`` and ``v`` are
    [num_tokens, num_kv_heads * head_size], for the whole packed batch. The layer writes the new
    K/V into its slice of the paged cache, then attends. The engine binds an ``AttentionImpl``
    and this layer's cache tensor with ``bind`` after choosing a backend.

    What the layer keeps per token is declared by ``get_kv_cache_spec``. ``k_scale`` and
    ``v_scale`` (float32 scalar parameters, 1.0 by default) are the scales of an fp8 cache:
    stored value = K / k_scale. They load from a checkpoint when it has them (see
    ``KV_SCALE_CHECKPOINT_NAMES``; a checkpoint without them is fine: they are
    ``optional_in_checkpoint``), and the plugin implementing ``hitchllm_kv_cache_scales``
    settles them before the first step (with ``calculate_kv_scales``: during the first step
    that serves prompts). Update them in place (``layer.k_scale.fill_(s)``),
    never by rebinding, so bound impls and captured CUDA graphs see the new value.
    """

    k_scale: torch.Tensor
    v_scale: torch.Tensor

    def __init__(
        self, num_heads: int, head_size: int, num_kv_heads: int, scale: float, layer_index: int,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.layer_index = layer_index
        self.sliding_window = sliding_window
        self.impl: AttentionImpl | None = None
        self.kv_cache: torch.Tensor | None = None
        # Parameters, so that checkpoint tensors route to them through their weight loader
        # like any weight (and their loading attributes survive moves between devices).
        for name in ("k_scale", "v_scale"):
            scale = nn.Parameter(torch.tensor(1.0, dtype=torch.float32), requires_grad=False)
            set_weight_attrs(scale, weight_loader=load_kv_scale, optional_in_checkpoint=True,
                             from_checkpoint=False)
            self.register_parameter(name, scale)

    @property
    def kv_scales_from_checkpoint(self) -> bool:
        """Whether the checkpoint gave this layer a ``k_scale`` or ``v_scale``."""
        return bool(self.k_scale.from_checkpoint or self.v_scale.from_checkpoint)

    def get_kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """What this layer stores per token in a cache of ``dtype`` with ``block_size``-token
        blocks (an MLA layer overrides this to declare its latent cache)."""
        return KVCacheSpec.for_attention(self.num_kv_heads, self.head_size, dtype, block_size,
                                         self.sliding_window)

    def bind(self, impl: AttentionImpl | None, kv_cache: torch.Tensor | None) -> None:
        """Attach the kernel and this layer's KV-cache tensor (None, None detaches them).
        The impl reads the layer's fp8 scales from then on."""
        self.impl = impl
        self.kv_cache = kv_cache
        if impl is not None:
            impl.k_scale, impl.v_scale = self.k_scale, self.v_scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        split = current_split_attention()
        if split is not None:
            return split(self, q, k, v)
        return self.attend(q, k, v)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write the new K/V into the cache and attend, with the forward context's metadata
        (what ``forward`` does unless the context splits attention off)."""
        if self.impl is None or self.kv_cache is None:
            raise RuntimeError(
                f"attention layer {self.layer_index} has no backend bound; build the model "
                "through hitchllm's engine"
            )
        metadata = get_forward_context().attn_metadata
        out = self.impl.forward(
            q.view(-1, self.num_heads, self.head_size),
            k.view(-1, self.num_kv_heads, self.head_size),
            v.view(-1, self.num_kv_heads, self.head_size),
            self.kv_cache,
            metadata,
        )
        return out.reshape(-1, self.num_heads * self.head_size)
