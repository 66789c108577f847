"""Micro-batches of concurrent steps (the engine side of pipeline-stage overlap), in one
process: the scheduler skips and never preempts the requests of steps in flight, one step
takes at most an M-th of the unfinished requests, and an engine that keeps M = 2 steps in
flight over disjoint requests generates what the plain engine generates (chunked prefill,
n > 1, prefix caching), aborts and contains failures without leaking KV blocks.

The engine here runs the micro-batch logic over the in-process runner (which, like a CPU
pipeline stage, has computed a step when it is launched): what the worker processes add is
tested in ``test_ppo_generation``."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from test_engine_faults import fail_requests

from hitchllm import LLM, SamplingParams
from hitchllm.kv_cache.manager import KVCacheManager
from hitchllm.request import Request, RequestStatus
from hitchllm.scheduler.scheduler import Scheduler, SchedulerConfig

# Prompts of different lengths; the 37-token one takes three steps of a 16-token budget.
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 47)), [300, 7, 7, 7, 9, 12, 200, 5, 1], [40, 41, 42],
           [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [99, 98]]
ENGINE = dict(dtype="float32", block_size=4, num_kv_blocks=96, max_model_len=96,
              max_num_batched_tokens=16)


def greedy(max_tokens: int = 10, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n)


def request(rid: str, num_tokens: int) -> Request:
    return Request(rid, list(range(1, num_tokens + 1)), greedy())


def scheduler(num_blocks: int = 64, max_num_seqs: int = 8, micro_batches: int = 2,
              budget: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                     max_model_len=64, num_micro_batches=micro_batches),
                     KVCacheManager(num_blocks, 4, False))


# ---- the scheduler -------------------------------------------------------------------------


def test_each_step_takes_an_mth_of_the_unfinished_requests_and_skips_busy_ones():
    s = scheduler()
    reqs = [request(f"r{i}", 3) for i in range(5)]
    for r in reqs:
        s.add_request(r)
    first = s.schedule()
    assert first.request_ids == ["r0", "r1", "r2"]  # ceil(5 / 2)
    second = s.schedule(busy={s.requests[rid] for rid in first.request_ids})
    assert second.request_ids == ["r3", "r4"]
    # With both micro-batches in flight nothing is free.
    assert s.schedule(busy=set(reqs)).is_empty
    # One micro-batch: a step takes every request it may.
    one = scheduler(micro_batches=1)
    for i in range(5):
        one.add_request(request(f"r{i}", 3))
    assert len(one.schedule().request_ids) == 5


def test_max_num_seqs_bounds_the_running_requests_of_all_micro_batches():
    s = scheduler(max_num_seqs=4)
    for i in range(6):
        s.add_request(request(f"r{i}", 3))
    first = s.schedule()
    assert first.request_ids == ["r0", "r1"]  # ceil(min(4, 6) / 2)
    second = s.schedule(busy={s.requests[rid] for rid in first.request_ids})
    assert second.request_ids == ["r2", "r3"]
    busy = {s.requests[rid] for rid in first.request_ids + second.request_ids}
    assert s.schedule(busy=busy).is_empty  # 4 running: r4 and r5 wait
    assert len(s.running) == 4 and len(s.waiting) == 2


def test_running_requests_split_over_micro_batches_when_the_cache_holds_few():
    """The KV cache holds 4 of 10 requests: with 6 waiting, the requests-in-all share is 5,
    but the 4 running ones still split 2 + 2 (else one step would take all 4 and the other
    find none free)."""
    s = scheduler(num_blocks=8, max_num_seqs=16)
    reqs = [request(f"r{i}", 7) for i in range(10)]  # 2 blocks each
    for r in reqs:
        s.add_request(r)
    first = s.schedule()
    assert first.request_ids == ["r0", "r1", "r2", "r3"]  # the cache is full
    assert s.schedule(busy=set(reqs[:4])).is_empty
    s.update_from_output(first, reqs[:4], {f"r{i}": [9] for i in range(4)})
    third = s.schedule()
    assert third.request_ids == ["r0", "r1"]  # ceil(4 running / 2)
    assert s.schedule(busy=set(reqs[:2])).request_ids == ["r2", "r3"]


def two_requests_filling_the_cache() -> tuple[Scheduler, Request, Request]:
    """``first`` came back with a token that needs a third block; ``second`` (2 blocks, the
    rest of the cache) was launched after it and is still in flight."""
    s = scheduler(num_blocks=4)
    first, second = request("first", 8), request("second", 8)
    s.add_request(first)
    s.add_request(second)
    p1 = s.schedule()
    p2 = s.schedule(busy={first})
    assert (p1.request_ids, p2.request_ids) == (["first"], ["second"])  # ceil(2 / 2) rows
    s.update_from_output(p1, [first], {"first": [9]})
    return s, first, second


def test_a_request_in_flight_is_never_preempted():
    """FCFS would preempt ``second`` (admitted last), but its step still writes its blocks:
    the request that needs a block gives way itself."""
    s, first, second = two_requests_filling_the_cache()
    assert first.status == RequestStatus.RUNNING
    blocks = s.kv_cache.get_block_ids("second")
    plan = s.schedule(busy={second})
    assert plan.request_ids == [] and plan.preempted_ids == ["first"]
    assert second.status == RequestStatus.RUNNING and first.status == RequestStatus.PREEMPTED
    assert s.kv_cache.get_block_ids("second") == blocks
    # Were ``second`` not in flight, it would be the victim.
    s, _, second = two_requests_filling_the_cache()
    plan = s.schedule()
    assert plan.preempted_ids == ["second"] and plan.request_ids == ["first"]


def test_num_micro_batches_must_be_positive():
    with pytest.raises(ValueError, match=r"num_micro_batches=0 must be at least 1"):
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=1, max_model_len=1,
                        num_micro_batches=0)


# ---- the engine ----------------------------------------------------------------------------


def micro_batched(llm: LLM, m: int = 2) -> list[list[str]]:
    """Turn on the engine's micro-batching (as ``pipeline_parallel_size=m`` does) and record
    each launched plan's request ids, checking that no step in flight holds any of them."""
    engine = llm.engine
    engine._micro_batches = m
    engine.scheduler.config = dataclasses.replace(engine.scheduler.config, num_micro_batches=m)
    launched: list[list[str]] = []
    execute = engine.executor.execute_model

    def execute_model(plan):
        in_flight = {r.request_id for step in engine._in_flight for r in step.requests}
        assert not in_flight & set(plan.request_ids), "a step of requests still in flight"
        if plan.request_ids:
            launched.append(list(plan.request_ids))
        return execute(plan)

    engine.executor.execute_model = execute_model
    return launched


def generate(llm: LLM, params: SamplingParams) -> list[list[list[int]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


def assert_no_leak(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert not engine._in_flight and not engine.scheduler.requests
    assert engine.kv_cache.num_free_blocks == engine.num_kv_blocks


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_two_micro_batches_generate_what_one_step_at_a_time_does(llama_path, prefix_caching):
    engine = dict(ENGINE, enable_prefix_caching=prefix_caching)
    params = greedy(n=2)
    expected = generate(LLM(llama_path, **engine), params)
    llm = LLM(llama_path, **engine)
    launched = micro_batched(llm)
    assert generate(llm, params) == expected
    assert llm.engine.stats().max_steps_in_flight == 2
    # Both micro-batches carried requests, and they alternate over disjoint requests.
    assert len(launched) >= 2
    assert any(set(a).isdisjoint(b) for a, b in itertools.pairwise(launched))
    assert all(len(ids) <= 6 for ids in launched)  # ceil(12 sequences / 2)
    assert_no_leak(llm)


def test_requests_that_stop_while_other_steps_are_in_flight(llama_path):
    """Stop tokens are found when a step's tokens come back: each request ends where it does
    in the plain engine (a stop token, or its own max_tokens), nothing past it is emitted."""
    plain = LLM(llama_path, **ENGINE)
    free_run = generate(plain, greedy(12))
    params = [SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[run[0][2 + i]])
              if i % 2 == 0 else greedy(3 + i) for i, run in enumerate(free_run)]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    expected = [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM(llama_path, **ENGINE)
    micro_batched(llm)
    got = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in expected]
    assert {o.finish_reason for o in got} == {"stop", "length"}
    assert llm.engine.stats().max_steps_in_flight == 2
    assert_no_leak(llm)


def test_without_micro_batches_at_most_one_step_waits(llama_path):
    """The counter is not stuck at its bound: an engine without micro-batches and without
    async scheduling completes every step before the next."""
    llm = LLM(llama_path, async_scheduling=False, **ENGINE)
    generate(llm, greedy())
    assert llm.engine.stats().max_steps_in_flight == 1


def test_abort_mid_run_frees_the_blocks_of_requests_in_flight(llama_path):
    expected = generate(LLM(llama_path, **ENGINE), greedy(12))
    llm = LLM(llama_path, **ENGINE)
    micro_batched(llm)
    engine = llm.engine
    ids = [engine.add_request({"prompt_token_ids": p}, greedy(12), request_id=f"r{i}")
           for i, p in enumerate(PROMPTS)]
    for _ in range(6):
        engine.step()
    in_flight = {r.request_id for step in engine._in_flight for r in step.requests}
    assert in_flight  # the aborted request is one whose step has not come back
    victim = sorted(in_flight)[0]
    [aborted] = engine.abort_request(victim)
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert set(final) == set(ids) - {victim}
    for rid, out in final.items():
        assert out.outputs[0].token_ids == expected[int(rid[1:])][0], rid
    assert_no_leak(llm)


def test_a_failing_request_is_isolated_while_another_step_is_in_flight(llama_path,
                                                                       monkeypatch):
    expected = generate(LLM(llama_path, **ENGINE), greedy())
    llm = LLM(llama_path, **ENGINE)
    micro_batched(llm)
    engine = llm.engine
    ids = [engine.add_request({"prompt_token_ids": p}, greedy(), request_id=f"r{i}")
           for i, p in enumerate(PROMPTS)]
    for _ in range(4):
        engine.step()
    fail_requests(engine, monkeypatch, {"r3"})
    final = {}
    for _ in range(300):
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert set(final) == set(ids)
    assert final.pop("r3").outputs[0].finish_reason == "error"
    for rid, out in final.items():
        assert out.outputs[0].token_ids == expected[int(rid[1:])][0], rid
    assert engine.scheduler.num_suspects == 0
    assert_no_leak(llm)
