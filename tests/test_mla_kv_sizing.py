"""The KV cache of an MLA model is sized from the latent spec: kv_lora_rank + rope dim values
per token and layer, one head-shared vector, not a key and a value per head."""

from __future__ import annotations

import logging

import pytest
from mla_checkpoints import build_tiny_deepseek

pytest.importorskip("hitchllm_attention_mla")

from hitchllm import LLM
from hitchllm.attention import KVCacheKind

LAYERS, KV_LORA_RANK, ROPE, BLOCK = 3, 32, 8, 4
BUDGET = 1 << 20


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = build_tiny_deepseek(tmp_path_factory.mktemp("v3"), "DeepseekV3ForCausalLM",
                               q_lora_rank=24, num_hidden_layers=LAYERS,
                               first_k_dense_replace=LAYERS)
    return LLM(path, block_size=BLOCK, kv_cache_memory=BUDGET,
               attention_backend="TORCH_MLA").engine


def test_blocks_come_from_the_latent_width(engine):
    per_block = LAYERS * BLOCK * (KV_LORA_RANK + ROPE) * 4  # float32
    assert engine.num_kv_blocks == BUDGET // per_block == 546
    # What per-head K and V (4 heads of qk 24 and v 12) would have cost: far fewer blocks.
    assert engine.num_kv_blocks > BUDGET // (LAYERS * BLOCK * 4 * (24 + 12) * 4)


def test_every_layer_declares_and_gets_a_latent_cache(engine):
    runner = engine.executor.runner
    specs = runner.kv_cache_specs
    assert [s.kind for s in specs] == [KVCacheKind.MLA_LATENT] * LAYERS
    assert {s.bytes_per_token for s in specs} == {(KV_LORA_RANK + ROPE) * 4}
    # One spare block takes the writes of padding slots.
    assert [tuple(c.shape) for c in runner.kv_caches] == \
        [(engine.num_kv_blocks + 1, BLOCK, KV_LORA_RANK + ROPE)] * LAYERS


def test_start_up_log_reports_latent_capacity(tmp_path, caplog):
    path = build_tiny_deepseek(tmp_path / "v2", "DeepseekV2ForCausalLM")
    with caplog.at_level(logging.INFO, logger="hitchllm"):
        LLM(path, block_size=BLOCK, kv_cache_memory=BUDGET, attention_backend="TORCH_MLA")
    blocks = BUDGET // (2 * BLOCK * (KV_LORA_RANK + ROPE) * 4)
    assert any(f"KV cache: {blocks} blocks of {BLOCK} tokens ({blocks * BLOCK} tokens)"
               in r.getMessage() for r in caplog.records)
