"""Swap preemption end to end on the CPU: greedy tokens under heavy preemption equal an
unpreempted run (and transformers), requests really are swapped, and both block pools are
whole again at the end, also after aborts of swapped-out requests and when the host pool is
too small (those preemptions fall back to recompute)."""

from __future__ import annotations

import pytest
from reference import hf_greedy
from test_engine_faults import fail_requests
from test_models_hf_parity import mixed_prompts

from hitchllm import LLM, EngineConfig, SamplingParams
from hitchllm.engine.kv_swap import host_pool_bytes
from hitchllm.entrypoints.cli import build_parser, engine_kwargs
from hitchllm.entrypoints.openai.metrics import ServerMetrics
from hitchllm.request import RequestStatus

ARCH = "Qwen3ForCausalLM"
MAX_TOKENS = 40
# 24 blocks of 4 tokens (96 slots) for 6 requests of up to 45 + 40 tokens: most steps preempt.
TIGHT = dict(block_size=4, num_kv_blocks=24)
SWAP = dict(TIGHT, preemption_mode="swap", swap_space=0.01)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def assert_pools_whole(llm: LLM) -> None:
    kv = llm.engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.num_free_host_blocks == kv.num_host_blocks
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    assert kv.host is None or all(b.ref_cnt == 0 for b in kv.host.pool.blocks)
    stats = llm.engine.stats()
    assert stats.host_blocks_used == 0 and stats.kv_cache_usage == 0.0


@pytest.fixture(scope="module")
def case(tiny_models):
    path = tiny_models[ARCH]
    prompts = mixed_prompts(3)
    unpreempted = LLM(path, block_size=4)
    expected = generate(unpreempted, prompts)
    assert unpreempted.engine.stats().num_preemptions == 0
    return path, prompts, expected


@pytest.mark.parametrize("caching,async_scheduling", [(True, True), (False, False)])
def test_swap_preemption_keeps_greedy_tokens(case, caching, async_scheduling):
    path, prompts, expected = case
    llm = LLM(path, enable_prefix_caching=caching, async_scheduling=async_scheduling, **SWAP)
    assert generate(llm, prompts) == expected
    stats = llm.engine.stats()
    assert stats.num_swap_outs > 0
    assert stats.num_swap_ins == stats.num_swap_outs
    assert stats.num_swap_fallbacks == 0
    assert_pools_whole(llm)
    # /metrics exports the counts.
    metrics = ServerMetrics("tiny")
    metrics.observe(llm.engine, [], 0.0)
    text = metrics.render().decode()
    assert f'hitchllm:num_swap_outs_total{{model_name="tiny"}} {stats.num_swap_outs}.0' in text
    assert 'hitchllm:host_kv_cache_blocks_used{model_name="tiny"} 0.0' in text


@pytest.mark.parametrize("extra", [
    # Drafts verified each step: no step is in flight when a request is swapped out.
    dict(speculative_method="ngram", num_speculative_tokens=3),
    # Prompts split over steps: requests are swapped out in the middle of their prompt.
    dict(max_num_batched_tokens=8),
    dict(scheduling_policy="priority"),
])
def test_swap_with_drafts_chunks_and_priorities(case, extra):
    path, prompts, expected = case
    llm = LLM(path, **SWAP, **extra)
    assert generate(llm, prompts) == expected
    assert llm.engine.stats().num_swap_outs > 0
    assert_pools_whole(llm)


def test_swap_run_matches_transformers(case):
    path, prompts, expected = case
    assert expected[:3] == hf_greedy(path, prompts[:3], MAX_TOKENS)


def test_swap_computes_fewer_tokens_than_recompute(case):
    """Swapped requests resume where they were: the engine schedules fewer tokens in all."""
    path, prompts, expected = case
    scheduled = {}
    for mode in ("recompute", "swap"):
        llm = LLM(path, **dict(SWAP, preemption_mode=mode, enable_prefix_caching=False))
        total = 0
        original = llm.engine.scheduler.schedule

        def counting(original=original):
            nonlocal total
            plan = original()
            total += plan.total_num_scheduled_tokens
            return plan

        llm.engine.scheduler.schedule = counting
        assert generate(llm, prompts) == expected
        assert llm.engine.stats().num_preemptions > 0
        scheduled[mode] = total
    assert scheduled["swap"] < scheduled["recompute"]


def test_a_host_pool_too_small_falls_back_to_recompute(case):
    path, prompts, expected = case
    probe = LLM(path, **SWAP).engine
    pool = host_pool_bytes(probe.attention_backend, probe.executor.kv_cache_specs, 10)
    llm = LLM(path, **dict(SWAP, swap_space=pool / 2**30))
    assert llm.engine.kv_cache.num_host_blocks == 10
    assert generate(llm, prompts) == expected
    stats = llm.engine.stats()
    assert stats.num_swap_fallbacks > 0  # requests of more than the free host blocks recomputed
    assert stats.num_swap_outs > 0  # and small ones swapped
    assert_pools_whole(llm)


def test_aborting_swapped_out_requests_frees_both_pools(case):
    path, prompts, expected = case
    llm = LLM(path, **SWAP)
    engine = llm.engine
    ids = [engine.add_request({"prompt_token_ids": p}, greedy()) for p in prompts]
    aborted = set()
    while engine.has_unfinished_requests():
        engine.step()
        swapped = [rid for rid in ids if rid not in aborted and engine.kv_cache.is_swapped(rid)]
        if swapped and len(aborted) < 3:
            engine.abort_request(swapped[0])
            aborted.add(swapped[0])
    assert len(aborted) == 3
    assert_pools_whole(llm)
    # The engine goes on serving: the same prompts give the same tokens.
    assert generate(llm, prompts) == expected


def test_recompute_mode_never_swaps(case):
    path, prompts, expected = case
    llm = LLM(path, **dict(SWAP, preemption_mode="recompute"))
    assert generate(llm, prompts) == expected
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.num_swap_outs == stats.num_host_blocks == 0


def test_auto_mode_follows_the_cost_rule(case):
    path, prompts, expected = case
    llm = LLM(path, **dict(SWAP, preemption_mode="auto"))
    cost = llm.engine.scheduler.swap_cost
    assert cost.swap_seconds_per_block is not None and cost.swap_seconds_per_block > 0
    # Copies made ruinously slow: every preemption recomputes.
    cost.swap_seconds_per_block = 1e6
    assert generate(llm, prompts) == expected
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.num_swap_outs == 0
    assert cost.recompute_tokens_per_s is not None and cost.recompute_tokens_per_s > 0
    # Copies made free: every preemption of a request with computed tokens swaps.
    cost.swap_seconds_per_block = 0.0
    assert generate(llm, prompts) == expected
    assert llm.engine.stats().num_swap_outs > 0
    assert_pools_whole(llm)


def test_swap_with_beams_sharing_blocks(case):
    """Beam search forks requests onto shared blocks: swapped-out beams keep their shared
    blocks on the device, and the search's result is unchanged."""
    from hitchllm import BeamSearchParams

    path, prompts, _ = case
    params = BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True)
    beam_prompts = [{"prompt_token_ids": p} for p in prompts[3:5]]
    want = LLM(path, block_size=4).beam_search(beam_prompts, params)
    llm = LLM(path, **dict(SWAP, num_kv_blocks=12))
    got = llm.beam_search(beam_prompts, params)
    assert [[s.tokens for s in o.sequences] for o in got] == \
        [[s.tokens for s in o.sequences] for o in want]
    # Beams are swapped out, and some end (the search drops them) while swapped out.
    stats = llm.engine.stats()
    assert stats.num_swap_outs > stats.num_swap_ins > 0
    assert_pools_whole(llm)


def test_swap_settings_are_checked():
    with pytest.raises(ValueError, match="swap_space is 0"):
        EngineConfig(preemption_mode="swap", swap_space=0)
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineConfig(preemption_mode="sometimes")


def test_host_pools_larger_than_most_of_the_memory_are_refused(monkeypatch):
    from hitchllm import config

    monkeypatch.setattr(config, "host_memory_bytes", lambda: 16 * 2**30)
    EngineConfig(preemption_mode="swap", swap_space=11)  # 69% of 16 GiB
    with pytest.raises(ValueError, match=r"22\.0 GiB of host memory, more than 70% of this "
                                         r"machine's 16\.0 GiB; lower swap_space"):
        EngineConfig(preemption_mode="auto", swap_space=11, tensor_parallel_size=2)
    EngineConfig(preemption_mode="recompute", swap_space=100)  # no pool: nothing to check


def test_a_swap_space_below_one_block_is_refused(case):
    path, _, _ = case
    with pytest.raises(ValueError, match="holds no KV block"):
        LLM(path, **dict(SWAP, swap_space=1e-9))


def test_cli_flags_reach_the_engine_config():
    args = build_parser().parse_args(
        ["generate", "--preemption-mode", "swap", "--swap-space", "2.5", "--prompt", "x"])
    kwargs = engine_kwargs(args)
    assert kwargs["preemption_mode"] == "swap" and kwargs["swap_space"] == 2.5


def test_a_swapped_request_is_waiting_with_its_tokens_computed(case):
    path, prompts, _ = case
    llm = LLM(path, **SWAP)
    engine = llm.engine
    for p in prompts:
        engine.add_request({"prompt_token_ids": p}, greedy())
    seen = False
    while engine.has_unfinished_requests() and not seen:
        engine.step()
        for request in engine.scheduler.waiting:
            if engine.kv_cache.is_swapped(request.request_id):
                seen = True
                assert request.status is RequestStatus.PREEMPTED
                assert request.num_computed_tokens > 0
                assert engine.kv_cache.get_block_ids(request.request_id) == []
    assert seen
    assert engine.stats().host_blocks_used > 0


def test_a_failing_request_under_swap_leaves_the_others_and_the_pools_whole(case, monkeypatch):
    """A failed step's swap-out copies may not have happened: the requests swapped out then
    are recomputed, the failing request ends with an error, the others match the clean run."""
    path, prompts, expected = case
    llm = LLM(path, **SWAP)
    engine = llm.engine
    ids = [engine.add_request({"prompt_token_ids": p}, greedy(), request_id=f"r{i}")
           for i, p in enumerate(prompts)]
    while not engine.stats().num_swap_outs:
        engine.step()
    fail_requests(engine, monkeypatch, {"r5"})
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["r5"].outputs[0].finish_reason == "error"
    for i, rid in enumerate(ids[:5]):
        assert finished[rid].outputs[0].token_ids == expected[i]
    assert_pools_whole(llm)
