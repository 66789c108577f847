"""The Llama family: Llama, Mistral, Qwen2 and Qwen3 share one decoder with small switches.

- Llama / Mistral: optional q/k/v/o bias (``attention_bias``), Mistral's sliding window.
- Qwen2: q/k/v bias always, no o bias.
- Qwen3: RMSNorm on each query and key head before rotary (q_norm / k_norm).

Projections are stacked (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``) so each step
runs two matmuls fewer per layer; ``load_weights`` maps the checkpoint's separate tensors in.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from hitchllm.attention import Attention
from hitchllm.config import ModelConfig
from hitchllm.models import fused
from hitchllm.models.norm import RMSNorm
from hitchllm.models.rope import RotaryEmbedding


@dataclass(frozen=True)
class FamilyTraits:
    """What distinguishes one architecture of the family."""

    qkv_bias: bool
    o_bias: bool
    qk_norm: bool


def family_traits(config: ModelConfig) -> FamilyTraits:
    """The switches for ``config.architecture``."""
    hf = config.hf_config
    if config.architecture == "Qwen2ForCausalLM":
        return FamilyTraits(qkv_bias=True, o_bias=False, qk_norm=False)
    bias = bool(hf.get("attention_bias", False))
    return FamilyTraits(
        qkv_bias=bias, o_bias=bias, qk_norm=config.architecture == "Qwen3ForCausalLM"
    )


class LlamaAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, traits: FamilyTraits, layer_index: int,
        rotary: RotaryEmbedding,
    ) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=traits.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=traits.o_bias)
        self.qk_norm = traits.qk_norm
        if traits.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary
        self.attn = Attention(
            self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim**-0.5, layer_index,
            sliding_window=config.sliding_window,
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = fused.qk_norm_rotary(positions, q, k, self.q_norm.weight, self.k_norm.weight,
                                        self.q_norm.eps, self.rotary.cos, self.rotary.sin)
        else:
            q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q.flatten(1), k.flatten(1), v))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, traits: FamilyTraits, layer_index: int,
        rotary: RotaryEmbedding,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, traits, layer_index, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(mlp output, residual stream)``; the next layer (or the final norm) adds
        them. ``residual`` is None for the first layer, whose ``hidden`` is the embedding."""
        if residual is None:
            normed, residual = self.input_layernorm(hidden), hidden
        else:
            normed, residual = self.input_layernorm.add_and_norm(hidden, residual)
        attn_out = self.self_attn(positions, normed)
        normed, residual = self.post_attention_layernorm.add_and_norm(attn_out, residual)
        return self.mlp(normed), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        traits = family_traits(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # One cos/sin table shared by every layer (it can be large for long-context models).
        rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta,
            config.rope_scaling,
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, traits, i, rotary) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        return self.norm.add_and_norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """A decoder-only LM over a packed batch: ``forward(input_ids [T], positions [T])``."""

    # Checkpoint tensor name fragment -> (our stacked parameter, shard index).
    _STACKED: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in, stacking q/k/v and gate/up; error on anything missing."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, shard = name, None
            for part, (stacked, index) in self._STACKED.items():
                if f".{part}." in name:
                    target, shard = name.replace(part, stacked), index
                    break
            if target not in params:
                unexpected.append(name)
                continue
            param = params[target]
            with torch.no_grad():
                if shard is None:
                    _copy_checked(param, tensor, name)
                else:
                    start, size = self._shard_range(target, shard)
                    _copy_checked(param.narrow(0, start, size), tensor, name)
            loaded.add(target if shard is None else f"{target}#{shard}")
        self._check_complete(params, loaded, unexpected)

    def _shard_range(self, target: str, shard: int) -> tuple[int, int]:
        cfg = self.config
        if "qkv_proj" in target:
            q = cfg.num_attention_heads * cfg.head_dim
            kv = cfg.num_key_value_heads * cfg.head_dim
            return [(0, q), (q, kv), (q + kv, kv)][shard]
        return (shard * cfg.intermediate_size, cfg.intermediate_size)

    def _check_complete(
        self, params: dict[str, nn.Parameter], loaded: set[str], unexpected: list[str]
    ) -> None:
        missing = []
        for name in params:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            shards = {"qkv_proj": 3, "gate_up_proj": 2}
            kind = next((k for k in shards if f".{k}." in name), None)
            if kind is None:
                if name not in loaded:
                    missing.append(name)
            else:
                parts = (f"{name}#{i}" for i in range(shards[kind]))
                missing += [p for p in parts if p not in loaded]
        problems = []
        for what, names in (("is missing", missing), ("has unexpected", unexpected)):
            if names:
                more = f" and {len(names) - 8} more" if len(names) > 8 else ""
                problems.append(f"{what} {len(names)} tensors: {', '.join(names[:8])}{more}")
        if problems:
            raise ValueError(f"the checkpoint does not fit {type(self).__name__} "
                             f"({self.config.architecture}): it " + "; it ".join(problems))


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}"
        )
    dst.copy_(src)
