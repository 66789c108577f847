"""The Llama family: Llama, Mistral, Qwen2 and Qwen3 share one decoder with small switches.

- Llama / Mistral: optional q/k/v/o bias (``attention_bias``), Mistral's sliding window.
- Qwen2: q/k/v bias always, no o bias.
- Qwen3: RMSNorm on each query and key head before rotary (q_norm / k_norm).

The mixture-of-experts members (Qwen3-MoE, Mixtral: ``hitchllm.models.moe``) subclass
``LlamaForCausalLM`` and swap each layer's MLP (``MAKE_MLP``) and the rule that places
per-expert checkpoint tensors (``ROUTE``).

Built from ``hitchllm.layers``: q/k/v run as one ``QKVParallelLinear`` and gate/up as one
``MergedColumnParallelLinear`` (two matmuls fewer per layer); their weight loaders place the
checkpoint's separate tensors in their slots, so ``load_weights`` only routes names. Every
linear layer asks ``quant_config`` (the active quantization method, or None) for its linear
method, with its parameter-name prefix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import islice
from typing import ClassVar

import torch
from torch import nn

from hitchllm import distributed
from hitchllm.attention import Attention, kv_scale_target
from hitchllm.attention.forward_context import current_split_attention
from hitchllm.config import ModelConfig
from hitchllm.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    QuantizationMethod,
    RowParallelLinear,
    VocabParallelEmbedding,
    load_named_weights,
)
from hitchllm.layers.loading import Route, Stacking
from hitchllm.models import fused, split_k
from hitchllm.models.norm import RMSNorm
from hitchllm.models.pipeline import AbsentLayer, StageLayout
from hitchllm.models.rope import RotaryEmbedding
from hitchllm.models.split_k import SplitSum

# The checkpoint's embedding, which a tied LM head shares.
_EMBEDDING = "model.embed_tokens.weight"
#: The ``layer.__dict__`` key under which a plugin may attach a kernel for a whole
#: ``PreNormDecoderLayer`` (attention_cpu's bfloat16 decode layer): a callable taking
#: ``(positions, hidden, residual)`` that returns what ``forward`` would return, equal bit for
#: bit, or None to leave the call to the modules. ``forward`` tries it only in a single-rank
#: tensor-parallel group (otherwise row-parallel linears sum across ranks), without autograd
#: and without the forward context's ``split_attention``; everything else is the kernel's to
#: check on every call, declining what it would not compute as the modules do (another linear
#: method, such as LoRA's or a reloaded layer's; other attention metadata; other dtypes or
#: shapes). It stays attached for the layer's lifetime and must not hold the layer strongly.
#: A per-layer slot rather than a hook: a kernel holds one layer's state and is looked up on
#: every call (docs/plugins.md, "Layer kernels", says why and the contract in full).
LAYER_KERNEL = "_layer_kernel"


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
        qkv_bias=bias, o_bias=bias,
        qk_norm=config.architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
    )


class LlamaAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, traits: FamilyTraits, layer_index: int,
        rotary: RotaryEmbedding, quant_config: QuantizationMethod | None, prefix: str,
    ) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads,
            config.num_key_value_heads, bias=traits.qkv_bias, quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        # This rank's heads (all of them in a world of one).
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=traits.o_bias,
            quant_config=quant_config, prefix=f"{prefix}.o_proj",
        )
        self.qk_norm = traits.qk_norm
        if traits.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary
        self.attn = Attention(
            self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim**-0.5, layer_index,
            sliding_window=config.sliding_window,
        )

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, split_sum: bool = False
    ) -> torch.Tensor | SplitSum:
        """The attention block's output; with ``split_sum``, possibly as ``o_proj``'s split
        sums for the next ``RMSNorm.add_and_norm`` (``hitchllm.models.split_k``)."""
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = fused.qk_norm_rotary(positions, q, k, self.q_norm.weight, self.k_norm.weight,
                                        self.q_norm.eps, self.rotary.cos, self.rotary.sin)
        else:
            q, k = self.rotary(positions, q, k)
        out = self.attn(q.flatten(1), k.flatten(1), v)
        return split_k.project(self.o_proj, out) if split_sum else self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(
        self, config: ModelConfig, quant_config: QuantizationMethod | None, prefix: str
    ) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            config.intermediate_size, config.hidden_size, quant_config=quant_config,
            prefix=f"{prefix}.down_proj",
        )

    def forward(self, x: torch.Tensor, split_sum: bool = False) -> torch.Tensor | SplitSum:
        """The MLP's output; with ``split_sum``, possibly as ``down_proj``'s split sums (as
        ``LlamaAttention.forward``)."""
        h = fused.silu_and_mul(self.gate_up_proj(x))
        return split_k.project(self.down_proj, h) if split_sum else self.down_proj(h)


# (config, layer index, quant_config, prefix of the layer's "mlp") -> the layer's MLP module.
MLPFactory = Callable[[ModelConfig, int, QuantizationMethod | None, str], nn.Module]


def dense_mlp(
    config: ModelConfig, layer_index: int, quant_config: QuantizationMethod | None, prefix: str
) -> nn.Module:
    """Every layer's MLP in the dense members of the family."""
    return LlamaMLP(config, quant_config, prefix)


class PreNormDecoderLayer(nn.Module):
    """A decoder layer of pre-norm attention and MLP blocks around one residual stream; a
    subclass builds ``input_layernorm``, ``self_attn`` (``(positions, hidden) -> hidden``),
    ``post_attention_layernorm`` and ``mlp``. Shared by the core's models and plugins' (the
    MLA plugin's DeepSeek layers)."""

    input_layernorm: RMSNorm
    self_attn: nn.Module
    post_attention_layernorm: RMSNorm
    mlp: nn.Module
    # Whether ``self_attn`` and ``mlp`` take ``split_sum=True`` and may then return a
    # ``SplitSum`` (``LlamaAttention``, ``LlamaMLP``), which the norm after them adds up.
    attention_splits_sum = False
    mlp_splits_sum = False

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor | SplitSum,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor | SplitSum, torch.Tensor]:
        """Returns ``(mlp output, residual stream)``; the next layer (or the final norm) adds
        them (the output may be a ``SplitSum``, which ``RMSNorm.add_and_norm`` takes).
        ``residual`` is None for the first layer, whose ``hidden`` is the embedding. A kernel
        attached as ``LAYER_KERNEL`` is tried first (see its contract)."""
        kernel = self.__dict__.get(LAYER_KERNEL)
        if (kernel is not None and distributed.tp_world_size() == 1
                and not torch.is_grad_enabled() and current_split_attention() is None):
            hidden = _materialized(hidden)
            out = kernel(positions, hidden, residual)
            if out is not None:
                return out
        if residual is None:
            residual = _materialized(hidden)
            normed = self.input_layernorm(residual)
        else:
            normed, residual = self.input_layernorm.add_and_norm(hidden, residual)
        if self.attention_splits_sum:
            attn_out = self.self_attn(positions, normed, split_sum=True)
        else:
            attn_out = self.self_attn(positions, normed)
        normed, residual = self.post_attention_layernorm.add_and_norm(attn_out, residual)
        if self.mlp_splits_sum:
            return self.mlp(normed, split_sum=True), residual
        return self.mlp(normed), residual


def _materialized(hidden: torch.Tensor | SplitSum) -> torch.Tensor:
    return hidden.total() if isinstance(hidden, SplitSum) else hidden


class LlamaDecoderLayer(PreNormDecoderLayer):
    """Attention and MLP with pre-norms; ``make_mlp`` builds the MLP (a dense ``LlamaMLP`` by
    default, a mixture of experts in the MoE members of the family)."""

    def __init__(
        self, config: ModelConfig, traits: FamilyTraits, layer_index: int,
        rotary: RotaryEmbedding, quant_config: QuantizationMethod | None, prefix: str,
        make_mlp: MLPFactory = dense_mlp,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, traits, layer_index, rotary, quant_config,
                                        f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = make_mlp(config, layer_index, quant_config, f"{prefix}.mlp")
        self.attention_splits_sum = True
        self.mlp_splits_sum = type(self.mlp).forward is LlamaMLP.forward


class PreNormDecoder(nn.Module):
    """Embedding, a stack of ``PreNormDecoderLayer`` s and a final norm that also adds the
    last layer's output to the residual stream; a subclass builds ``embed_tokens``,
    ``layers`` and ``norm``. Shared by the core's models and plugins' (DeepSeek).

    A subclass that sets ``stage`` (a ``StageLayout``) runs as one pipeline stage: it builds
    only that stage's modules, receives the hidden state and residual from the previous
    stage instead of embedding (unless first) and sends them on instead of the final norm
    (unless last; it then returns its last layer's output, which no one reads)."""

    embed_tokens: nn.Module
    layers: nn.ModuleList
    norm: nn.Module
    stage: StageLayout | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        stage = self.stage
        if stage is None or stage.is_first:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = stage.receive(input_ids.shape[0], input_ids.device)
        layers = self.layers if stage is None else islice(self.layers, stage.layers.start,
                                                          stage.layers.stop)
        for layer in layers:
            hidden, residual = layer(positions, hidden, residual)
        if stage is not None and not stage.is_last:
            hidden = _materialized(hidden)
            stage.send(hidden, residual)
            return hidden
        return self.norm.add_and_norm(hidden, residual)[0]


class LlamaModel(PreNormDecoder):
    def __init__(
        self, config: ModelConfig, quant_config: QuantizationMethod | None, prefix: str,
        make_mlp: MLPFactory = dense_mlp,
    ) -> None:
        super().__init__()
        traits = family_traits(config)
        # This process's pipeline stage (all layers without pipeline parallelism).
        self.stage = stage = StageLayout.current(config.num_hidden_layers, config.hidden_size)
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, prefix=f"{prefix}.embed_tokens"
        ) if stage.is_first else AbsentLayer()
        # One cos/sin table shared by every layer (it can be large for long-context models).
        rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta,
            config.rope_scaling,
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, traits, i, rotary, quant_config, f"{prefix}.layers.{i}",
                              make_mlp) if i in stage.layers else AbsentLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if stage.is_last \
            else AbsentLayer()


class LlamaForCausalLM(nn.Module):
    """A decoder-only LM over a packed batch: ``forward(input_ids [T], positions [T])``."""

    # Checkpoint module name -> (our stacked module, its slot).
    STACKED: ClassVar[Stacking] = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    # Builds each layer's MLP; the mixture-of-experts members replace it.
    MAKE_MLP: ClassVar[MLPFactory] = staticmethod(dense_mlp)
    # Checkpoint names placed by a rule rather than STACKED (experts), or None.
    ROUTE: ClassVar[Route | None] = None
    # Builds one pipeline stage when pipeline_parallel_size > 1 (see ``PreNormDecoder``).
    SUPPORTS_PIPELINE_PARALLEL: ClassVar[bool] = True

    def __init__(
        self, config: ModelConfig, quant_config: QuantizationMethod | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, quant_config, "model", self.MAKE_MLP)
        stage = self.model.stage
        tied = config.tie_word_embeddings
        # A last stage that is not also the first loads its own copy of a tied embedding.
        self._head_from_embedding = tied and stage.is_last and not stage.is_first
        if not stage.is_last:
            self.lm_head: nn.Module = AbsentLayer()
            return
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, quant_config=None if tied else quant_config,
            prefix="lm_head",
        )
        if tied and stage.is_first:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Route checkpoint tensors to parameters; error on anything missing or unexpected.
        fp8 KV-cache scales (``self_attn.k_scale``, ``self_attn.k_proj.output_scale``, ...)
        load into the layer's ``Attention`` when present."""
        tied = self.config.tie_word_embeddings

        def skip(name: str) -> bool:
            return ("rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight")
                    or not self.wants_checkpoint_tensor(name))

        def rename(name: str) -> str | None:
            if self._head_from_embedding and name == _EMBEDDING:
                return "lm_head.weight"
            return self.rename_weight(name)

        load_named_weights(
            self, weights, self.STACKED, skip=skip,
            description=f"{type(self).__name__} ({self.config.architecture})",
            rename=rename, route=self.ROUTE,
        )

    def wants_checkpoint_tensor(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to this process's pipeline stage (every
        tensor does without pipeline parallelism); the loader reads no other."""
        return self.model.stage.holds(name) or (self._head_from_embedding
                                                and name == _EMBEDDING)

    def rename_weight(self, name: str) -> str | None:
        """The parameter name of a checkpoint tensor the model spells differently, or None."""
        return kv_scale_target(name, "self_attn", "attn")
