"""DeepSeek-V2 and DeepSeek-V3: decoders with multi-head latent attention.

Attention (per layer): the query comes from ``q_proj`` (V2-Lite, ``q_lora_rank`` null) or from
``q_a_proj -> q_a_layernorm -> q_b_proj``; ``kv_a_proj_with_mqa`` gives the compressed KV
(``kv_lora_rank``, normalized by ``kv_a_layernorm``) and the key's shared rotary part; rope
rotates only the rotary parts (``rope.py``); ``MLAAttention`` caches the latent and attends;
``o_proj`` maps the heads' values back.

Feed-forward: layers below ``first_k_dense_replace`` (every layer, for a dense config) use a
gated SiLU MLP; the others are mixture-of-experts layers (``deepseek_moe``): routed experts
in hitchllm's ``FusedMoE`` plus shared experts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from hitchllm import distributed
from hitchllm.config import ModelConfig
from hitchllm.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    QuantizationMethod,
    ReplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    expert_route,
    load_named_weights,
)
from hitchllm.layers.loading import Route, Stacking
from hitchllm.models.llama import PreNormDecoder, PreNormDecoderLayer
from hitchllm.models.norm import RMSNorm
from hitchllm_attention_mla.deepseek_moe import DeepseekMLP, DeepseekMoE
from hitchllm_attention_mla.layer import MLAAttention, MLADims
from hitchllm_attention_mla.rope import DeepseekRotaryEmbedding, softmax_scale


def is_moe_layer(hf: dict[str, Any], layer_index: int) -> bool:
    """Whether layer ``layer_index`` of config ``hf`` is a mixture-of-experts layer: from
    ``first_k_dense_replace`` on, as transformers builds them."""
    return layer_index >= (hf.get("first_k_dense_replace") or 0)


class DeepseekAttention(nn.Module):
    """Multi-head latent attention with DeepSeek's projections."""

    def __init__(self, config: ModelConfig, layer_index: int, rotary: DeepseekRotaryEmbedding,
                 quant_config: QuantizationMethod | None, prefix: str) -> None:
        super().__init__()
        hf = config.hf_config
        heads = config.num_attention_heads
        self.dims = MLADims(
            num_heads=heads // distributed.tp_world_size(),
            kv_lora_rank=hf["kv_lora_rank"], qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"])
        d, hidden, bias = self.dims, config.hidden_size, bool(hf.get("attention_bias", False))
        q_lora_rank = hf.get("q_lora_rank")
        self.q_lora = q_lora_rank is not None
        if self.q_lora:
            self.q_a_proj = ReplicatedLinear(hidden, q_lora_rank, bias=bias,
                                             quant_config=quant_config, prefix=f"{prefix}.q_a_proj")
            self.q_a_layernorm = RMSNorm(q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(q_lora_rank, heads * d.qk_head_dim,
                                                 quant_config=quant_config,
                                                 prefix=f"{prefix}.q_b_proj")
        else:
            self.q_proj = ColumnParallelLinear(hidden, heads * d.qk_head_dim,
                                               quant_config=quant_config, prefix=f"{prefix}.q_proj")
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            hidden, d.latent_width, bias=bias, quant_config=quant_config,
            prefix=f"{prefix}.kv_a_proj_with_mqa")
        self.kv_a_layernorm = RMSNorm(d.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(
            d.kv_lora_rank, heads * (d.qk_nope_head_dim + d.v_head_dim),
            quant_config=quant_config, prefix=f"{prefix}.kv_b_proj")
        self.o_proj = RowParallelLinear(heads * d.v_head_dim, hidden, bias=bias,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.rotary = rotary
        self.attn = MLAAttention(d, softmax_scale(d.qk_head_dim, config.rope_scaling),
                                 layer_index, self.kv_b_proj)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        d = self.dims
        q = (self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden))) if self.q_lora
             else self.q_proj(hidden)).view(-1, d.num_heads, d.qk_head_dim)
        q_nope, q_pe = q.split([d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(hidden).split([d.kv_lora_rank, d.qk_rope_head_dim],
                                                           dim=-1)
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe)
        return self.o_proj(self.attn(q_nope, q_pe, self.kv_a_layernorm(c_kv), k_pe))


def moe_block(config: ModelConfig, layer_index: int, quant_config: QuantizationMethod | None,
              prefix: str) -> nn.Module:
    """The feed-forward of mixture-of-experts layer ``layer_index``: routed experts (V2's
    greedy / group-limited softmax top-k or V3's biased sigmoid grouped top-k) plus shared
    experts; see ``deepseek_moe``. Checkpoint names under ``{prefix}``: ``gate.weight``,
    ``gate.e_score_correction_bias`` (V3), ``experts.{e}.{gate,up,down}_proj.weight``
    (``DeepseekForCausalLM.ROUTE``), ``shared_experts.{gate,up,down}_proj.weight``."""
    return DeepseekMoE(config, quant_config, prefix)


class DeepseekDecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: ModelConfig, layer_index: int, rotary: DeepseekRotaryEmbedding,
                 quant_config: QuantizationMethod | None, prefix: str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DeepseekAttention(config, layer_index, rotary, quant_config,
                                           f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = (moe_block(config, layer_index, quant_config, f"{prefix}.mlp")
                    if is_moe_layer(config.hf_config, layer_index)
                    else DeepseekMLP(config.hidden_size, config.intermediate_size,
                                     config.hidden_act, quant_config, f"{prefix}.mlp"))


class DeepseekModel(PreNormDecoder):
    def __init__(self, config: ModelConfig, quant_config: QuantizationMethod | None,
                 prefix: str) -> None:
        super().__init__()
        hf = config.hf_config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   prefix=f"{prefix}.embed_tokens")
        # V2 always rotates interleaved pairs; V3 does unless rope_interleave is false.
        interleaved = config.architecture == "DeepseekV2ForCausalLM" or \
            hf.get("rope_interleave", True)
        rotary = DeepseekRotaryEmbedding(hf["qk_rope_head_dim"], config.max_position_embeddings,
                                         config.rope_theta, config.rope_scaling, interleaved)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(config, i, rotary, quant_config, f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekForCausalLM(nn.Module):
    """DeepSeek-V2 / V3 over a packed batch: ``forward(input_ids [T], positions [T])``."""

    STACKED: ClassVar[Stacking] = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    # Routed experts' gate/up/down tensors go to their slots of the stacked expert weights
    # before STACKED (which would send them to a gate_up_proj) sees them.
    ROUTE: ClassVar[Route] = staticmethod(expert_route())

    def __init__(self, config: ModelConfig, quant_config: QuantizationMethod | None = None
                 ) -> None:
        super().__init__()
        if not config.use_mla:
            raise ValueError(f"{config.path}/config.json has no kv_lora_rank: "
                             f"{config.architecture} needs DeepSeek's MLA fields")
        self.config = config
        self.model = DeepseekModel(config, quant_config, "model")
        tied = config.tie_word_embeddings
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size,
                                      quant_config=None if tied else quant_config,
                                      prefix="lm_head")
        if tied:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Route checkpoint tensors to parameters; error on anything missing or unexpected.
        V3's multi-token-prediction layers (``model.layers.{num_hidden_layers + i}``, ``i <
        num_nextn_predict_layers``) are skipped, as transformers skips them."""
        tied = self.config.tie_word_embeddings
        layers = self.config.num_hidden_layers
        mtp = tuple(f"model.layers.{layers + i}." for i in
                    range(self.config.hf_config.get("num_nextn_predict_layers") or 0))

        def skip(name: str) -> bool:
            return ("rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight")
                    or name.startswith(mtp))

        load_named_weights(
            self, weights, self.STACKED, skip=skip,
            description=f"{type(self).__name__} ({self.config.architecture})",
            route=self.ROUTE,
        )


class DeepseekV2ForCausalLM(DeepseekForCausalLM):
    """DeepSeek-V2 (and V2-Lite, without ``q_lora_rank``)."""


class DeepseekV3ForCausalLM(DeepseekForCausalLM):
    """DeepSeek-V3: as V2, with ``rope_interleave`` and sigmoid ``noaux_tc`` routing (with
    ``e_score_correction_bias``) in its MoE layers."""
