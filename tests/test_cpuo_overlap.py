"""Overlap on the CPU: under ``async_scheduling`` the model runs on the executor's worker
thread while the engine's thread schedules, prepares and builds outputs. Tokens must equal the
one-step-at-a-time engine's (greedy and seeded rows, stop strings, aborts, failures)."""

from __future__ import annotations

import threading

from test_models_hf_parity import mixed_prompts

from hitchllm import LLM, SamplingParams

ARCH = "LlamaForCausalLM"


def _outputs(llm: LLM, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
            for o in outs]


def _forward_threads(llm: LLM) -> list[str]:
    """Record the thread each forward runs on."""
    names: list[str] = []
    llm.engine.executor.runner.model.register_forward_pre_hook(
        lambda module, args: names.append(threading.current_thread().name))
    return names


def test_forward_runs_on_a_worker_thread_and_tokens_match(tiny_models):
    path = tiny_models[ARCH]
    overlapped = LLM(path, block_size=4, async_scheduling=True)
    sequential = LLM(path, block_size=4, async_scheduling=False)
    assert sequential.engine.executor._thread is None
    prompts = mixed_prompts(9, lengths=(3, 8, 21, 40, 13, 30, 6, 17))
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    reference = _outputs(sequential, prompts, greedy)
    texts = [r[0][1] for r in reference]
    tokens = [r[0][0] for r in reference]
    params = [
        greedy,
        SamplingParams(temperature=0.0, max_tokens=20, stop=[texts[1][5:8]]),
        SamplingParams(temperature=0.0, max_tokens=20, stop=[texts[2][3:5]],
                       include_stop_str_in_output=True),
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[tokens[3][4]]),
        SamplingParams(temperature=0.8, top_k=20, max_tokens=20, seed=7),
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=15, seed=11, logprobs=2),
        SamplingParams(n=2, temperature=0.7, max_tokens=12, seed=3),
    ]
    params += [greedy] * (len(prompts) - len(params))
    seen = _forward_threads(overlapped)
    got = _outputs(overlapped, prompts, params)
    assert got == _outputs(sequential, prompts, params)
    assert any(r[0][2] == "stop" for r in got)  # the stop strings did stop requests
    assert seen and all(name.startswith("hitchllm-forward") for name in seen)
    assert threading.current_thread().name not in seen


def test_step_returns_while_the_next_forward_still_runs(llama_path):
    """The engine's thread gets the previous step's outputs while the step it launched is
    still computing: the forward of the second step is held until ``step`` returned."""
    llm = LLM(llama_path, block_size=4, async_scheduling=True)
    engine = llm.engine
    entered, release = threading.Event(), threading.Event()
    forwards: list[int] = []
    released: list[bool] = []

    def hold_second(module, args):
        forwards.append(1)
        if len(forwards) == 2:
            entered.set()
            # Released by the test once ``step`` returned: never, if ``step`` waited for this.
            released.append(release.wait(10))

    engine.executor.runner.model.register_forward_pre_hook(hold_second)
    engine.add_request("def f(x):", SamplingParams(temperature=0, max_tokens=4,
                                                   ignore_eos=True))
    assert engine.step() == []  # launched; its tokens come with the next call
    try:
        outputs = engine.step()  # launches step 2 (held) and returns step 1's token
        assert len(outputs) == 1 and len(outputs[0].outputs[0].token_ids) == 1
        # Step 2's forward started, and cannot have finished: it waits for ``release``.
        assert entered.wait(10)
    finally:
        release.set()
    while engine.has_unfinished_requests():
        outputs = engine.step()
    assert len(outputs[0].outputs[0].token_ids) == 4
    assert released == [True]
    assert engine.kv_cache.num_free_blocks == engine.num_kv_blocks


def test_abort_while_a_step_runs_keeps_other_requests_exact(llama_path):
    prompts = ["def add(a, b):", "import os\n", "class Point:", "while True:"]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in LLM(llama_path, async_scheduling=False)
                 .generate(prompts, greedy, use_tqdm=False)]
    engine = LLM(llama_path, async_scheduling=True).engine
    ids = [engine.add_request(p, greedy) for p in prompts]
    final = {}
    aborted = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == ids[1] and len(out.outputs[0].token_ids) >= 5 and not aborted:
                # A step holding this request is in flight now: its token is dropped.
                final.update({o.request_id: o for o in engine.abort_request(ids[1])})
                aborted = True
            if out.finished:
                final[out.request_id] = out
    cut = final[ids[1]].outputs[0]
    assert cut.finish_reason == "abort" and 5 <= len(cut.token_ids) < 16
    assert cut.token_ids == reference[1][: len(cut.token_ids)]
    for i in (0, 2, 3):
        assert final[ids[i]].outputs[0].token_ids == reference[i]
    assert engine.kv_cache.num_free_blocks == engine.num_kv_blocks


def test_a_failure_on_the_worker_thread_ends_only_its_request(llama_path, monkeypatch):
    prompts = ["def add(a, b):", "import os\n", "class Point:"]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(llama_path, async_scheduling=True)
    clean = [o.outputs[0].text for o in llm.generate(prompts, greedy, use_tqdm=False)]
    engine = llm.engine
    runner = engine.executor.runner
    original = runner._generator_for
    failed_on: list[str] = []

    def generator_for(request):
        if request.request_id == "bad":
            failed_on.append(threading.current_thread().name)
            raise RuntimeError("injected")
        return original(request)

    monkeypatch.setattr(runner, "_generator_for", generator_for)
    for i, p in enumerate(prompts):
        engine.add_request(p, greedy, request_id="bad" if i == 1 else f"r{i}")
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert final["bad"].outputs[0].finish_reason == "error"
    assert [final[f"r{i}"].outputs[0].text for i in (0, 2)] == [clean[0], clean[2]]
    assert failed_on and all(n.startswith("hitchllm-forward") for n in failed_on)


def test_close_stops_the_worker_thread(llama_path):
    llm = LLM(llama_path, async_scheduling=True)
    llm.generate(["x = 1"], SamplingParams(max_tokens=2), use_tqdm=False)
    pool = llm.engine.executor._thread
    llm.engine.close()
    assert llm.engine.executor._thread is None
    assert all(not t.is_alive() for t in pool._threads)
