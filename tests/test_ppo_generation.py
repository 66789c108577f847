"""Pipeline stages overlap on the CPU (gloo, one worker process per stage): with
``pipeline_parallel_size=2`` the engine keeps 2 steps in flight over disjoint requests (stage 0
computes one while stage 1 computes the other) and generates what one process does: greedy
requests of different lengths with chunked prefill, n = 2 and prefix caching, checked against
the engine at world size 1 and, for two prompts, against Hugging Face transformers. A request
aborted while its step is in flight leaves no block behind, and the executor refuses a plan
that schedules a request of a step still in flight."""

from __future__ import annotations

import time

import pytest
from reference import hf_greedy
from tp_support import TP_TEST_TIMEOUT_S, only_builtin_plugins, tp_llm  # noqa: F401

from hitchllm import LLM, SamplingParams
from hitchllm.scheduler.step_plan import NewRequestData, StepPlan

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 47)), [300, 7, 7, 7, 9, 12, 200, 5, 1], [40, 41, 42],
           [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [99, 98]]
MAX_TOKENS = 8
# fp32; a 16-token budget chunks the 37- and 18-token prompts; n = 2 children share their
# prompt's blocks, and prefix caching shares the 4-token blocks of equal prompt starts.
ENGINE = dict(dtype="float32", block_size=4, num_kv_blocks=96, max_model_len=96,
              max_num_batched_tokens=16, enable_prefix_caching=True)


def greedy(n: int = 1, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n)


def generate(llm: LLM, params: SamplingParams) -> list[list[list[int]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


def assert_no_leak(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests() and not engine.scheduler.requests
    assert engine.kv_cache.num_free_blocks == engine.num_kv_blocks
    assert not engine.executor._unread_ids  # every step's answer was read


def abort_mid_run(llm: LLM, expected: list[list[list[int]]]) -> None:
    """Abort a request whose step is in flight; the others finish as without the abort."""
    engine = llm.engine
    ids = [engine.add_request({"prompt_token_ids": p}, greedy(max_tokens=12), request_id=f"a{i}")
           for i, p in enumerate(PROMPTS)]
    for _ in range(6):
        engine.step()
    in_flight = sorted(r.request_id for step in engine._in_flight for r in step.requests)
    assert in_flight
    [aborted] = engine.abort_request(in_flight[0])
    assert aborted.outputs[0].finish_reason == "abort"
    final = {}
    start = time.monotonic()
    while engine.has_unfinished_requests() and time.monotonic() - start < TP_TEST_TIMEOUT_S:
        final.update((o.request_id, o) for o in engine.step() if o.finished)
    assert set(final) == set(ids) - {in_flight[0]}
    for rid, out in final.items():
        assert out.outputs[0].token_ids == expected[int(rid[1:])][0], rid


def test_pp2_overlaps_two_steps_and_generates_what_one_process_does(
        llama_path, only_builtin_plugins):  # noqa: F811
    one = LLM(llama_path, **ENGINE)
    expected = generate(one, greedy(n=2))
    expected_long = generate(one, greedy(max_tokens=12))
    assert [e[0] for e in expected_long[:2]] == hf_greedy(llama_path, PROMPTS[:2], 12)
    start = time.monotonic()
    with tp_llm(llama_path, pipeline_parallel_size=2, **ENGINE) as llm:
        assert generate(llm, greedy(n=2)) == expected
        # Stage 0 got the next micro-batch before stage 1's answer of the previous one was
        # read (the engine's count, and the executor's of plans sent but not answered).
        assert llm.engine.stats().max_steps_in_flight == 2
        assert llm.engine.executor.max_unread_steps == 2
        assert llm.engine.stats().prefix_cache_hits > 0
        assert_no_leak(llm)
        abort_mid_run(llm, expected_long)
        assert_no_leak(llm)
        # A plan with a request of a step in flight is refused before it reaches a stage.
        executor = llm.engine.executor
        new = NewRequestData("probe", [1, 2, 3], greedy())
        future = executor.execute_model(StepPlan(["probe"], [3], [0], [True], [[0]], [new]))
        with pytest.raises(ValueError, match=r"^request\(s\) \['probe'\] are scheduled while a "
                                             r"step in flight still computes them"):
            executor.execute_model(StepPlan(["probe"], [1], [3], [True], [[]]))
        assert list(future.result().sampled) == ["probe"]
    assert time.monotonic() - start < TP_TEST_TIMEOUT_S
