"""``benchmarks/configs/deepseek-v2-lite.json`` and ``benchmarks/build_model.py``: the config
has DeepSeek-V2-Lite's published shape, and a shrunk copy of it (same fields, few layers,
small dims) builds through the benchmark's script path into a checkpoint that hitchllm loads
and decodes exactly as transformers does (fp32)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from reference import hf_greedy
from test_models_hf_parity import mixed_prompts, run

pytest.importorskip("hitchllm_attention_mla")

from hitchllm import LLM

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "benchmarks" / "configs" / "deepseek-v2-lite.json"

#: Small dims (and the tokenizer's EOS id 0); everything else (q_lora_rank null,
#: YaRN with mscale, greedy routing, shared experts, first dense layer, no renormalization)
#: stays as published.
SHRINK = dict(hidden_size=64, num_hidden_layers=3, intermediate_size=96, kv_lora_rank=32,
              qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_attention_heads=4,
              num_key_value_heads=4, n_routed_experts=8, moe_intermediate_size=24,
              vocab_size=512, initializer_range=0.15, bos_token_id=0, eos_token_id=0)


def test_config_has_the_published_deepseek_v2_lite_shape():
    raw = json.loads(CONFIG.read_text())
    assert raw["architectures"] == ["DeepseekV2ForCausalLM"]
    assert {k: raw[k] for k in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "q_lora_rank",
        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
        "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size",
        "first_k_dense_replace", "intermediate_size", "vocab_size", "topk_method")} == {
        "hidden_size": 2048, "num_hidden_layers": 27, "num_attention_heads": 16,
        "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64,
        "num_experts_per_tok": 6, "n_shared_experts": 2, "moe_intermediate_size": 1408,
        "first_k_dense_replace": 1, "intermediate_size": 10944, "vocab_size": 102400,
        "topk_method": "greedy"}
    assert raw["rope_scaling"] == {
        "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}


def test_shrunk_copy_builds_and_decodes_as_transformers(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.delitem(sys.modules, "build_model", raising=False)
    import build_model

    raw = {**json.loads(CONFIG.read_text()), **SHRINK}
    shrunk = tmp_path / "deepseek-v2-lite-shrunk.json"
    shrunk.write_text(json.dumps(raw))
    path = build_model.build(shrunk, tmp_path / "model")
    built = json.loads((path / "config.json").read_text())
    assert built["num_hidden_layers"] == 3 and built["q_lora_rank"] is None
    prompts = mixed_prompts(lengths=(1, 9, 30))
    expected = hf_greedy(str(path), prompts, 6)
    llm = LLM(str(path), block_size=4, attention_backend="TORCH_MLA")
    assert run(llm, prompts, max_tokens=6) == expected
