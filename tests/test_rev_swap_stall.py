"""Review: device blocks that only swapped-out requests keep (an ``n=2`` request's sequences
share their prompt's blocks, which stay on the device when both are swapped out) must not stop
the one running request that needs them: the engine recomputes the swapped-out requests and
goes on, instead of failing the step with "scheduler made no progress"."""

from __future__ import annotations

import pytest

from hitchllm import LLM, SamplingParams

NUM_BLOCKS = 10
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": list(range(20, 29))}]
# The first request alone fills the whole cache by its end; the pair outlives the moment the
# cache is full, so both of its sequences are swapped out.
PARAMS = [SamplingParams(temperature=0, max_tokens=4 * NUM_BLOCKS - 3, ignore_eos=True),
          SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True)]


def tokens(llm: LLM) -> list[list[list[int]]]:
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_kept_blocks_of_swapped_siblings_never_fail_a_step(llama_path, async_scheduling):
    want = tokens(LLM(llama_path, block_size=4, enable_prefix_caching=False))
    llm = LLM(llama_path, block_size=4, num_kv_blocks=NUM_BLOCKS, preemption_mode="swap",
              swap_space=0.01, enable_prefix_caching=False, async_scheduling=async_scheduling)
    assert tokens(llm) == want
    stats = llm.engine.stats()
    assert stats.num_swap_outs >= 2 and stats.num_swap_fallbacks >= 2
    kv = llm.engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks and kv.num_free_host_blocks == kv.num_host_blocks
