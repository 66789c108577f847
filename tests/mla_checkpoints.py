"""Tiny random DeepSeek-V2/V3 checkpoints for the MLA tests (transformers builds them, and is
the oracle for them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hitchllm.tiny_model import build_tokenizer

#: Named configs: V2-Lite style (no q_lora_rank), V2 with q_lora_rank and YaRN (DeepSeek's
#: mscale / mscale_all_dim), V3 with q_lora_rank, interleaved rope and YaRN.
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "v2-lite": ("DeepseekV2ForCausalLM", {"q_lora_rank": None}),
    "v2-yarn": ("DeepseekV2ForCausalLM", {
        "q_lora_rank": 24,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 32, "mscale": 0.707,
                         "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}}),
    "v3-yarn": ("DeepseekV3ForCausalLM", {
        "q_lora_rank": 24,
        "rope_scaling": {"rope_type": "yarn", "factor": 8.0,
                         "original_max_position_embeddings": 16, "mscale": 1.0,
                         "mscale_all_dim": 0.8}}),
}


#: Mixture-of-experts configs: one dense layer then two MoE layers of 8 routed experts and
#: shared ones. V2 routes greedily (with ``norm_topk_prob`` set, which V2 ignores) or
#: group-limited; V2-Lite has no q_lora_rank; V3 routes with sigmoid scores, grouped top-k and a
#: non-zero ``e_score_correction_bias`` (``correction_bias_std``) that changes the choice.
_MOE: dict[str, Any] = dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8,
                            moe_intermediate_size=24)
MOE_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "v2-moe-greedy": ("DeepseekV2ForCausalLM", {
        **_MOE, "q_lora_rank": 24, "topk_method": "greedy", "num_experts_per_tok": 3,
        "n_shared_experts": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.5}),
    "v2-moe-grouped": ("DeepseekV2ForCausalLM", {
        **_MOE, "q_lora_rank": 24, "topk_method": "group_limited_greedy", "n_group": 4,
        "topk_group": 2, "num_experts_per_tok": 3, "n_shared_experts": 1,
        "routed_scaling_factor": 2.0}),
    "v2-lite-moe": ("DeepseekV2ForCausalLM", {
        **_MOE, "q_lora_rank": None, "topk_method": "greedy", "num_experts_per_tok": 2,
        "n_shared_experts": 2}),
    "v3-moe": ("DeepseekV3ForCausalLM", {
        **_MOE, "q_lora_rank": 24, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "correction_bias_std": 0.05}),
}


def build_tiny_deepseek(path: str | Path, architecture: str, seed: int = 0,
                        correction_bias_std: float = 0.0, **overrides: Any) -> str:
    """Write a tiny random DeepSeek checkpoint whose every layer is dense
    (``first_k_dense_replace == num_hidden_layers``) unless ``overrides`` say otherwise.
    ``correction_bias_std`` gives V3's MoE routers a random ``e_score_correction_bias``
    (transformers initializes it to zero)."""
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    fields: dict[str, Any] = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=2,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, n_group=1, topk_group=1, max_position_embeddings=256,
        rms_norm_eps=1e-6, initializer_range=0.15, bos_token_id=eos, eos_token_id=eos,
        pad_token_id=eos, tie_word_embeddings=False,
    )
    fields.update(overrides)
    config = getattr(transformers, architecture.replace("ForCausalLM", "Config"))(**fields)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.randn_like(buffer) * correction_bias_std)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
