"""Review: pipeline stages (micro-batches in flight) with swap preemption and aborts of
requests in each state: in flight in a micro-batch, swapped out, waiting. The requests that go
on produce what one process does, and both block pools are whole at the end."""

from __future__ import annotations

import time

from tp_support import TP_TEST_TIMEOUT_S, only_builtin_plugins, tp_llm  # noqa: F401

from hitchllm import LLM, SamplingParams

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 47)), [300, 7, 7, 7, 9, 12, 200, 5, 1], [40, 41, 42],
           list(range(60, 75)), [9, 8, 7, 6]]
ENGINE = dict(dtype="float32", block_size=4, max_model_len=96, max_num_batched_tokens=16)
GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


def test_pp2_swap_with_aborts_in_every_state(llama_path, only_builtin_plugins):  # noqa: F811
    ref = LLM(llama_path, **ENGINE)
    expected = [o.outputs[0].token_ids for o in ref.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)]
    start = time.monotonic()
    with tp_llm(llama_path, num_kv_blocks=20, preemption_mode="swap", swap_space=0.01,
                pipeline_parallel_size=2, **ENGINE) as llm:
        engine = llm.engine
        ids = [engine.add_request({"prompt_token_ids": p}, GREEDY) for p in PROMPTS]
        done, aborted, states = {}, set(), set()
        while engine.has_unfinished_requests():
            assert time.monotonic() - start < TP_TEST_TIMEOUT_S
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            busy = {r.request_id for launched in engine._in_flight for r in launched.requests
                    if not launched.plan.is_empty}
            live = [rid for rid in ids if rid not in aborted and rid not in done
                    and rid in engine.scheduler.requests]
            for rid in live:
                state = ("swapped" if engine.kv_cache.is_swapped(rid) else
                         "in_flight" if rid in busy else None)
                if state is not None and state not in states:
                    engine.abort_request(rid)
                    aborted.add(rid)
                    states.add(state)
                    break
        assert states == {"swapped", "in_flight"}
        for i, rid in enumerate(ids):
            if rid not in aborted:
                assert done[rid] == expected[i], rid
        stats = engine.stats()
        assert stats.num_swap_outs > 0
        kv = engine.kv_cache
        assert kv.num_free_blocks == kv.num_blocks
        assert kv.num_free_host_blocks == kv.num_host_blocks
        # The engine goes on serving: every prompt again gives the same tokens.
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
    assert time.monotonic() - start < TP_TEST_TIMEOUT_S
