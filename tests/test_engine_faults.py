"""No request can take the engine down: sampling parameters are validated against what the
sampler computes in float32, and a step that fails anyway is narrowed down to the request that
fails alone, which ends with ``finish_reason="error"`` while every other request goes on."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hitchllm import LLM, SamplingParams
from hitchllm.engine.llm_engine import MAX_CONSECUTIVE_STEP_FAILURES

PROMPTS = ["def add(a, b):", "import os\n", "class Point:", "for i in range(10):",
           "x = [1, 2, 3]", "while True:", "print('hello')"]


@pytest.fixture(scope="module")
def llm(llama_path):
    return LLM(llama_path, block_size=4, num_kv_blocks=256, max_model_len=128,
               attention_backend="TORCH")


def greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def texts(outputs) -> list[str]:
    return [o.outputs[0].text for o in outputs]


def fail_requests(engine, monkeypatch, bad_ids: set[str], calls: list[str] | None = None):
    """Make every step that samples for a request in ``bad_ids`` raise (as a sampler bug
    tied to one request's parameters would)."""
    original = engine.executor.runner._sampling_metadata

    def sampling_metadata(sampling, *args):
        for request, _ in sampling:
            if calls is not None:
                calls.append(request.request_id)
            if request.request_id in bad_ids:
                raise RuntimeError("injected failure")
        return original(sampling, *args)

    monkeypatch.setattr(engine.executor.runner, "_sampling_metadata", sampling_metadata)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_failing_request_is_isolated_and_others_match_a_clean_run(
    llama_path, monkeypatch, async_scheduling
):
    llm = LLM(llama_path, block_size=4, num_kv_blocks=256, max_model_len=128,
              async_scheduling=async_scheduling)
    clean = texts(llm.generate(PROMPTS, greedy(), use_tqdm=False))
    engine = llm.engine
    ids = [engine.add_request(p, greedy(), request_id=f"r{i}") for i, p in enumerate(PROMPTS)]
    for _ in range(2):  # let every request start decoding first
        engine.step()
    fail_requests(engine, monkeypatch, {"r3"})
    final = {}
    for _ in range(200):
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert set(final) == set(ids)
    bad = final.pop("r3")
    assert bad.outputs[0].finish_reason == "error"
    assert "RuntimeError" in bad.error and "injected" not in bad.error
    for rid, out in final.items():
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].text == clean[int(rid[1:])], rid
    assert engine.kv_cache.num_free_blocks == engine.num_kv_blocks
    assert engine.scheduler.num_suspects == 0
    # The engine keeps serving, the failed request's parameters included.
    monkeypatch.undo()
    assert texts(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == clean


@pytest.mark.parametrize("where", ["sampling", "forward", "launch"])
@pytest.mark.parametrize("bad", [{"r1"}, {"r0", "r1", "r4"}])
def test_a_plan_waiting_for_a_failing_step_is_dropped_cleanly(llama_path, monkeypatch, bad,
                                                               where):
    """``min_tokens`` makes each plan wait for the step in flight (its tokens decide the
    next): when that step fails, the waiting plan never reaches the runner. Its requests are
    recomputed (the blocks it was to write leave the prefix cache) and the ids it reported go
    out with the next plan; before, the requests it admitted ran later as if the runner knew
    them (KeyError) and were ended as failed. A plan whose own launch fails was handed to the
    executor, which may have acted on it (its KV transfers come first): it is never sent
    again (a KV load finished twice raises in the connector)."""
    llm = LLM(llama_path, block_size=4, num_kv_blocks=256, max_model_len=128, max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=6)
    clean = texts(llm.generate(PROMPTS, params, use_tqdm=False))
    engine = llm.engine
    # No block of the clean run may stand in for one the dropped plan never wrote.
    assert engine.kv_cache.reset_prefix_cache()
    runner = engine.executor.runner
    launch, forward, sample_step = runner._launch, runner._eager_forward, runner._sample_step
    planned = []

    def fails(plan) -> bool:
        return any(rid in bad and new == 1 and computed > 0 for rid, new, computed in zip(
            plan.request_ids, plan.num_scheduled_tokens, plan.num_computed_tokens))

    seen = []  # every plan handed to the executor
    execute = engine.executor.execute_model
    requeue = engine.scheduler.requeue_unsent

    def recording_launch(plan):
        planned[:] = [plan]
        return launch(plan)

    def handing(plan):  # the executor may act on a plan before its launch fails
        seen.append(plan)
        if where == "launch" and fails(plan):
            raise RuntimeError("injected failure")
        return execute(plan)

    def checked_requeue(plan):  # only a plan the executor never saw goes out again
        assert all(plan is not p for p in seen), "a plan handed to the executor was requeued"
        return requeue(plan)

    def failing_forward(*args):  # before any K/V of the step is written
        if where == "forward" and fails(planned[0]):
            raise RuntimeError("injected failure")
        return forward(*args)

    def failing_sampling(plan, *args):  # after: the step's K/V is written, its tokens not
        if where == "sampling" and fails(plan):
            raise RuntimeError("injected failure")
        return sample_step(plan, *args)

    monkeypatch.setattr(runner, "_launch", recording_launch)
    monkeypatch.setattr(engine.executor, "execute_model", handing)
    monkeypatch.setattr(engine.scheduler, "requeue_unsent", checked_requeue)
    monkeypatch.setattr(runner, "_eager_forward", failing_forward)
    monkeypatch.setattr(runner, "_sample_step", failing_sampling)
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, params, request_id=f"r{i}")
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert set(final) == {f"r{i}" for i in range(len(PROMPTS))}
    for rid, out in final.items():
        if rid in bad:
            assert out.outputs[0].finish_reason == "error"
            assert "RuntimeError" in out.error, out.error
        else:
            assert out.outputs[0].finish_reason == "length", (rid, out.error)
            assert out.outputs[0].text == clean[int(rid[1:])], rid
    assert engine.kv_cache.num_free_blocks == engine.num_kv_blocks


def test_isolation_takes_logarithmic_steps(llm, monkeypatch):
    engine = llm.engine
    calls: list[str] = []
    fail_requests(engine, monkeypatch, {"r5"}, calls)
    for i, p in enumerate(PROMPTS * 2):
        engine.add_request(p, greedy(4), request_id=f"r{i}")
    failed_steps = 0
    while engine.has_unfinished_requests():
        before = engine._consecutive_failures
        engine.step()
        failed_steps += engine._consecutive_failures > before
    # 14 requests: the failing step, then halves of 7, 4, 2, 1 -> at most 5 failed steps.
    assert 1 <= failed_steps <= 2 + math.ceil(math.log2(14))
    assert engine.kv_cache.num_free_blocks == engine.num_kv_blocks


def test_n_greater_than_one_fails_as_a_whole(llm, monkeypatch):
    engine = llm.engine
    fail_requests(engine, monkeypatch, {"1_par"})
    engine.add_request("def f(x):", SamplingParams(n=3, temperature=1.0, max_tokens=6,
                                                   seed=1, ignore_eos=True), request_id="par")
    engine.add_request("import os", greedy(6), request_id="ok")
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert [c.finish_reason for c in final["par"].outputs] == ["error"] * 3
    assert final["ok"].outputs[0].finish_reason == "length"
    assert engine.kv_cache.num_free_blocks == engine.num_kv_blocks


def test_a_step_that_always_fails_ends_the_engine(llama_path, monkeypatch):
    engine = LLM(llama_path, block_size=4, num_kv_blocks=256, max_model_len=128).engine

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.executor.runner, "execute_async", broken)
    for i, p in enumerate(PROMPTS * 6):
        engine.add_request(p, greedy(4), request_id=f"d{i}")
    with pytest.raises(RuntimeError, match="device lost"):
        for _ in range(10 * MAX_CONSECUTIVE_STEP_FAILURES):
            engine.step()


@pytest.mark.parametrize("params", [
    {"seed": 2**64}, {"seed": -(2**63) - 1}, {"seed": 2**64 - 1, "n": 2}, {"top_p": 1e-300},
    {"repetition_penalty": 1e-46}, {"temperature": 1e39}, {"top_k": 2**70},
    {"max_tokens": 2**70}, {"temperature": float("nan")}, {"n": True}, {"seed": 1.5},
    {"stop": [1]},
])
def test_parameters_the_sampler_cannot_compute_are_rejected(params):
    with pytest.raises(ValueError):
        SamplingParams(**params)


@pytest.mark.parametrize("params", [
    {"seed": 2**64 - 1}, {"seed": -(2**63)}, {"seed": 2**64 - 2, "n": 2},
    {"top_p": 1e-30, "temperature": 1.0},
    {"repetition_penalty": 1e-30, "top_p": 0.5},
    {"repetition_penalty": 1e30, "top_p": 0.5},
    {"temperature": 2e-5, "top_p": 0.9, "min_p": 1e-30},
    {"temperature": 3e38, "top_k": 3},
])
def test_extreme_but_valid_parameters_generate(llm, params):
    [out] = llm.generate(["def f(x):"], SamplingParams(max_tokens=4, ignore_eos=True, **params),
                         use_tqdm=False)
    assert all(c.finish_reason == "length" and len(c.token_ids) == 4 for c in out.outputs)


def _extreme_floats(low: float, high: float):
    return st.one_of(st.floats(low, high), st.sampled_from([low, high]),
                     st.floats(allow_nan=True, allow_infinity=True))


sampling_params = st.fixed_dictionaries({}, optional={
    "n": st.integers(-2, 4),
    "temperature": _extreme_floats(0.0, 1e38),
    "top_p": _extreme_floats(0.0, 1.0),
    "top_k": st.one_of(st.integers(-2, 100), st.integers(-(2**70), 2**70)),
    "min_p": _extreme_floats(0.0, 1.0),
    "seed": st.one_of(st.none(), st.integers(-(2**65), 2**65)),
    "presence_penalty": _extreme_floats(-2.0, 2.0),
    "frequency_penalty": _extreme_floats(-2.0, 2.0),
    "repetition_penalty": _extreme_floats(1e-45, 1e38),
    "max_tokens": st.one_of(st.none(), st.integers(-1, 6), st.integers(2**40, 2**70)),
    "min_tokens": st.integers(-1, 6),
    "logprobs": st.one_of(st.none(), st.integers(-1, 3), st.integers(2**40, 2**70)),
    "stop_token_ids": st.lists(st.integers(-1, 2**70), max_size=2),
})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kwargs=sampling_params)
def test_random_sampling_params_are_rejected_or_complete(llm, kwargs):
    """Either validation raises ValueError, or the request completes and frees its blocks."""
    try:
        params = SamplingParams(**kwargs)
        if params.max_tokens is None or params.max_tokens > 6:
            params.max_tokens = 6  # keep each example short; validity was already decided
            params.min_tokens = min(params.min_tokens, 6)
        outputs = llm.generate(["def f(x):"], params, use_tqdm=False)
    except ValueError:
        return
    for c in outputs[0].outputs:
        assert c.finish_reason in ("length", "stop")
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.num_kv_blocks, kwargs


def test_an_end_of_sequence_id_outside_the_vocabulary_is_reported_and_unused(
        llama_path, tmp_path, caplog):
    """A generation_config naming an eos id past the vocabulary (it can never be sampled)
    used to crash the sampler's min_tokens mask; it is logged and left out."""
    import json
    import shutil

    path = tmp_path / "model"
    shutil.copytree(llama_path, path)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    gen = path / "generation_config.json"
    config = json.loads(gen.read_text()) if gen.is_file() else {}
    config["eos_token_id"] = [vocab + 7]
    gen.write_text(json.dumps(config))
    with caplog.at_level("WARNING", logger="hitchllm.engine.llm_engine"):
        llm = LLM(str(path))
    assert f"[{vocab + 7}]" in caplog.text
    assert all(0 <= i < vocab for i in llm.engine.eos_token_ids)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                       SamplingParams(temperature=0, max_tokens=5, min_tokens=3),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 3
