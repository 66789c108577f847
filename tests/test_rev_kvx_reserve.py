"""Review: a consumer whose incoming requests reserve every KV block must still run them. Each
reservation held the prompt's KV but not its last token's slot; when the reservations filled
the cache, no request could compute its last prompt token (none runs, so none can be
preempted) and the engine failed with "scheduler made no progress". Also under swap
preemption, where the loaded requests are then swapped out and back in while decoding."""

from __future__ import annotations

import pytest
from test_kvx_engine import GREEDY, PREFILL, kv_config, run, tokens

from hitchllm.config import EngineConfig
from hitchllm.engine.llm_engine import LLMEngine

# Prompts of 2 full blocks and one more token: each reservation takes 2 blocks, and 4 of them
# take all 8.
PROMPTS = [list(range(10 * i + 1, 10 * i + 10)) for i in range(4)]
ENGINE = dict(block_size=4, max_model_len=64)


@pytest.mark.parametrize("preemption", [dict(), dict(preemption_mode="swap", swap_space=0.01)])
def test_reservations_that_fill_the_cache_still_decode(llama_path, tmp_path, preemption):
    reference = LLMEngine(EngineConfig(model=llama_path, **ENGINE))
    want = tokens(run(reference, PROMPTS, GREEDY))
    path = str(tmp_path / "kv")
    producer = LLMEngine(EngineConfig(model=llama_path, **ENGINE, kv_transfer_config=kv_config(
        "shared_memory", "producer", path=path)))
    consumer = LLMEngine(EngineConfig(model=llama_path, **ENGINE, num_kv_blocks=8,
                                      **preemption, kv_transfer_config=kv_config(
                                          "shared_memory", "consumer", kv_load_timeout_s=20)))
    try:
        outs = run(producer, PROMPTS, PREFILL, [{"do_remote_decode": True}] * len(PROMPTS))
        params = [o.kv_transfer_params for o in outs]
        assert tokens(run(consumer, PROMPTS, GREEDY, params, timeout_s=30)) == want
        stats = consumer.stats()
        assert stats.kv_transfer.num_loads == len(PROMPTS) and stats.kv_load_fallbacks == 0
        assert stats.num_preemptions > 0  # the loaded requests outgrow the cache while decoding
        assert (stats.num_swap_outs > 0) == bool(preemption)
        assert consumer.kv_cache.num_free_blocks == consumer.kv_cache.num_blocks
        assert consumer.kv_cache.num_free_host_blocks == consumer.kv_cache.num_host_blocks
    finally:
        producer.close()
        consumer.close()
