"""The driver's side of pipeline stages: once a step's tokens are folded into the scheduler,
the next micro-batch is launched before that step's outputs are built (detokenizing, stop
strings), so the stages do not wait for output processing. A request that a stop string ends
may then be in the micro-batch just launched: it ends where the plain engine ends it, and
its blocks come back. Runs the engine's micro-batching over the in-process runner (as
test_ppo_microbatches does; worker processes are covered by test_ppo_generation)."""

from __future__ import annotations

import time

from test_ppo_microbatches import ENGINE, PROMPTS, assert_no_leak, micro_batched

from hitchllm import LLM, SamplingParams

STOPS = ["qu", "readab", "fox", "code", "mor", "upon"]


def test_the_next_micro_batch_launches_before_a_steps_outputs_are_built(llama_path):
    llm = LLM(llama_path, **ENGINE)
    engine = llm.engine
    micro_batched(llm)
    events: list[tuple[str, set[str]]] = []
    execute, process = engine.executor.execute_model, engine.output_processor.process

    def execute_model(plan):
        events.append(("launch", set(plan.request_ids)))
        return execute(plan)

    def process_outputs(updated, *args):
        events.append(("outputs", {r.request_id for r in updated if not r.finished}))
        return process(updated, *args)

    engine.executor.execute_model = execute_model
    engine.output_processor.process = process_outputs
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], params, use_tqdm=False)
    checked = 0
    for i, (kind, ids) in enumerate(events):
        if kind == "outputs" and ids:
            # The requests of the step whose outputs these are run again already.
            launched = next(e for e in reversed(events[:i]) if e[0] == "launch")[1]
            assert ids <= launched, (i, events[max(0, i - 4): i + 1])
            checked += 1
    assert checked >= 8
    assert_no_leak(llm)


def test_stop_strings_end_requests_as_without_micro_batches(llama_path):
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
              for stop in STOPS]
    expected = [o.outputs[0] for o in LLM(llama_path, **ENGINE).generate(
        prompts, params, use_tqdm=False)]
    assert {o.finish_reason for o in expected} == {"stop"}
    llm = LLM(llama_path, **ENGINE)
    micro_batched(llm)
    got = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [(o.text, o.finish_reason) for o in got] == [
        (o.text, o.finish_reason) for o in expected]
    # A stopped request's extra step may still be in flight: it completes, and every block
    # comes back.
    start = time.monotonic()
    while llm.engine.has_unfinished_requests() and time.monotonic() - start < 30:
        assert llm.engine.step() == []
    assert_no_leak(llm)
