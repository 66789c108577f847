"""Chunked prefill, preemption, prefix caching and parallel sampling never change greedy tokens."""

from __future__ import annotations

import pytest
from reference import hf_greedy
from test_models_hf_parity import MAX_NEW, greedy, mixed_prompts, run

from hitchllm import LLM, SamplingParams

ARCH = "Qwen3ForCausalLM"


@pytest.fixture(scope="module")
def reference(tiny_models):
    path = tiny_models[ARCH]
    prompts = mixed_prompts(7)
    return path, prompts, hf_greedy(path, prompts, MAX_NEW)


def test_chunked_prefill_matches_one_shot(reference):
    path, prompts, expected = reference
    llm = LLM(path, block_size=4, max_num_batched_tokens=6)
    assert run(llm, prompts) == expected
    assert max(len(p) for p in prompts) > 6  # prompts really were split


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_under_tiny_kv_budget_keeps_tokens(reference, caching):
    path, prompts, expected = reference
    # 16 blocks of 4 tokens: the longest request alone needs 15 blocks, so most steps preempt.
    llm = LLM(path, block_size=4, num_kv_blocks=16, enable_prefix_caching=caching)
    assert run(llm, prompts) == expected
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.kv_cache_usage == 0.0
    assert llm.engine.kv_cache.num_free_blocks == 16


@pytest.mark.parametrize("caching", [True, False])
def test_shared_prefix_prompts_hit_the_cache(tiny_models, caching):
    path = tiny_models[ARCH]
    system = mixed_prompts(8, lengths=(24,))[0]
    prompts = [system + tail for tail in ([7, 8, 9], [10, 11], [12, 13, 14, 15])]
    expected = hf_greedy(path, prompts, MAX_NEW)
    llm = LLM(path, block_size=4, enable_prefix_caching=caching)
    # First request alone warms the cache; the others then share its 6 prefix blocks.
    assert run(llm, prompts[:1]) == expected[:1]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected[1:]
    hits = [o.num_cached_tokens for o in outs]
    if caching:
        assert hits == [24, 24]
        assert llm.engine.stats().prefix_cache_hits >= 48
    else:
        assert hits == [0, 0]
        assert llm.engine.stats().prefix_cache_hits == 0


def test_full_prompt_hit_still_computes_last_token(tiny_models):
    path = tiny_models[ARCH]
    prompt = mixed_prompts(9, lengths=(16,))[0]  # exactly 4 full blocks of 4
    llm = LLM(path, block_size=4)
    first = run(llm, [prompt])
    again = llm.generate([{"prompt_token_ids": prompt}], greedy(), use_tqdm=False)[0]
    assert again.outputs[0].token_ids == first[0]
    assert again.num_cached_tokens == 12  # never the whole prompt


@pytest.mark.parametrize("caching", [True, False])
def test_parallel_sampling_shares_prompt_blocks(tiny_models, caching):
    path = tiny_models[ARCH]
    prompt = mixed_prompts(10, lengths=(20,))[0]
    llm = LLM(path, block_size=4, enable_prefix_caching=caching)
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # seeds seed+i differ
    # Two of the three children reuse the first one's 4 full prompt blocks.
    assert llm.engine.stats().prefix_cache_hits == 2 * 16
    assert llm.engine.kv_cache.usage == 0.0
    again = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_generation_stops_at_max_model_len(tiny_models):
    llm = LLM(tiny_models[ARCH], max_model_len=24)
    out = llm.generate([{"prompt_token_ids": list(range(5, 25))}],
                       SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == 4


def test_requests_that_can_never_fit_are_rejected_up_front(tiny_models):
    llm = LLM(tiny_models[ARCH], block_size=4, num_kv_blocks=8, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": [5] * 65}], use_tqdm=False)
    with pytest.raises(ValueError, match="KV cache holds 32"):
        llm.generate([{"prompt_token_ids": [5] * 20}], SamplingParams(max_tokens=20),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": []}], use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([{"prompt_token_ids": [10**6]}], use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(["hi"], SamplingParams(stop_token_ids=[10**6]), use_tqdm=False)
    # A batch with one bad prompt queues nothing, and the engine still serves the next call.
    with pytest.raises(ValueError):
        llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [5] * 65}],
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_cache.usage == 0.0
    out = llm.generate([{"prompt_token_ids": [5] * 20}], SamplingParams(max_tokens=10),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 10


def test_abort_frees_blocks_at_once(tiny_models):
    llm = LLM(tiny_models[ARCH], block_size=4)
    engine = llm.engine
    keep = engine.add_request({"prompt_token_ids": list(range(5, 30))},
                              SamplingParams(max_tokens=50, ignore_eos=True))
    drop = engine.add_request({"prompt_token_ids": list(range(40, 70))},
                              SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    used = engine.kv_cache.usage
    final = engine.abort_request(drop)
    assert final[0].outputs[0].finish_reason == "abort"
    assert engine.kv_cache.usage < used
    done = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == keep
            done = out
    assert done.finished and len(done.outputs[0].token_ids) == 50
    assert engine.kv_cache.usage == 0.0


@pytest.mark.parametrize("caching", [True, False])
def test_blocks_shared_within_one_step_hold_the_right_values(tiny_models, caching):
    """n > 1 children are admitted in the same step: the later ones attend over blocks the
    first one writes in that very forward pass. Greedy children must all equal the reference."""
    path = tiny_models[ARCH]
    prompt = mixed_prompts(12, lengths=(27,))[0]
    expected = hf_greedy(path, [prompt], MAX_NEW)[0]
    llm = LLM(path, block_size=4, enable_prefix_caching=caching)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [expected] * 3
    assert llm.engine.stats().prefix_cache_hits == 2 * 24
