"""Overlapped steps (``async_scheduling``): step n+1 is scheduled and launched before step n's
tokens reach the host, its pending input tokens taken from the device. Every output must equal
the one-step-at-a-time engine's, whatever stops the requests."""

from __future__ import annotations

import pytest
from test_models_hf_parity import mixed_prompts

from hitchllm import LLM, SamplingParams

ARCH = "Qwen3ForCausalLM"


def _outputs(llm: LLM, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
            for o in outs]


def _pair(path: str, **kwargs) -> tuple[LLM, LLM]:
    return (LLM(path, async_scheduling=True, **kwargs),
            LLM(path, async_scheduling=False, **kwargs))


def _count_device_inputs(llm: LLM) -> list[int]:
    """Count scheduled tokens whose id came from the device (the overlap really happened)."""
    runner = llm.engine.executor.runner
    prepare = runner._prepare_inputs
    seen = [0]

    def counting(rows, num_sched, num_computed, graph_size, known, *rest):
        seen[0] += int((num_computed + num_sched - known).clip(min=0).sum())
        return prepare(rows, num_sched, num_computed, graph_size, known, *rest)

    runner._prepare_inputs = counting
    return seen


def test_overlapped_steps_equal_sequential_steps(tiny_models):
    path = tiny_models[ARCH]
    prompts = mixed_prompts(11, lengths=(1, 5, 17, 30, 44, 9))
    overlapped, sequential = _pair(path, block_size=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    reference = _outputs(sequential, prompts, greedy)
    # Stop tokens and stop strings taken from the free-running output end requests mid-way.
    tokens = [r[0][0] for r in reference]
    texts = [r[0][1] for r in reference]
    # Unseeded random rows draw from the engine's generator, whose stream depends on how many
    # rows each step has: only greedy and seeded rows compare across the two modes.
    params = [
        greedy,
        SamplingParams(temperature=0.0, max_tokens=3),
        SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[tokens[2][6]]),
        SamplingParams(temperature=0.0, max_tokens=24, stop=[texts[3][4:7]]),
        SamplingParams(max_tokens=24, temperature=0.9, top_p=0.8, seed=5),
        # Penalties and min_tokens need every output token on the host: no overlap while
        # this request runs.
        SamplingParams(max_tokens=10, temperature=1.0, repetition_penalty=1.3, min_tokens=8,
                       seed=9),
    ]
    seen = _count_device_inputs(overlapped)
    assert _outputs(overlapped, prompts, params) == _outputs(sequential, prompts, params)
    assert seen[0] > 0
    for llm in (overlapped, sequential):
        assert llm.engine.kv_cache.num_free_blocks == llm.engine.num_kv_blocks
        assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("caching", [True, False])
def test_overlap_with_preemption_and_chunked_prefill(tiny_models, caching):
    path = tiny_models[ARCH]
    prompts = mixed_prompts(7)
    kwargs = dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=8,
                  enable_prefix_caching=caching)
    overlapped, sequential = _pair(path, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert _outputs(overlapped, prompts, params) == _outputs(sequential, prompts, params)
    assert overlapped.engine.stats().num_preemptions > 0
    assert overlapped.engine.kv_cache.num_free_blocks == 16


def test_overlap_with_parallel_sampling_and_abort(tiny_models):
    path = tiny_models[ARCH]
    overlapped, sequential = _pair(path, block_size=4)
    params = SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=12)
    prompts = mixed_prompts(2, lengths=(6, 13))
    assert _outputs(overlapped, prompts, params) == _outputs(sequential, prompts, params)
    engine = overlapped.engine
    rid = engine.add_request({"prompt_token_ids": prompts[0]},
                             SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_cache.num_free_blocks == engine.num_kv_blocks


def test_a_request_that_stops_while_its_next_step_is_scheduled_writes_no_other_block(
    llama_path,
):
    """A stop token sampled in step n ends a request that step n + 1 already computes; that
    step must write its K/V into the request's own blocks, never into a stale block-table
    entry (which once corrupted prefix-cached prompts). Penalties keep step n + 1 from
    launching before step n completes, so the request is stopped when n + 1 launches."""
    llm = LLM(llama_path, block_size=4, async_scheduling=True)
    tokenizer = llm.get_tokenizer()
    prompts = ["Answer in JSON:", "def f(x):", "import os", "class A:"]
    base = SamplingParams(temperature=0, repetition_penalty=1.2, max_tokens=24, ignore_eos=True)
    free = [o.outputs[0].token_ids for o in LLM(llama_path, enable_prefix_caching=False)
            .generate(prompts, base, use_tqdm=False)]
    params = []
    for prompt, out in zip(prompts, free):
        length = len(tokenizer(prompt).input_ids)
        # The first output token that stops the request with its pending position at the
        # start of a new block.
        k = next(k for k in range(1, len(out)) if (length + k) % 4 == 0 and out[k] not in out[:k])
        params.append(SamplingParams(temperature=0, repetition_penalty=1.2, max_tokens=24,
                                     ignore_eos=True, stop_token_ids=[out[k]]))
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.engine.stats().prefix_cache_hits > 0
    assert first == [out[: len(o)] for out, o in zip(free, first)]
    assert again == first
