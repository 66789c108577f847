"""Beam search's input checks, and its results under KV-cache pressure (preemption)."""

from __future__ import annotations

import pytest

from hitchllm import LLM, BeamSearchParams
from hitchllm.sampling_params import SamplingParams

PROMPTS = [{"prompt_token_ids": [7, 19, 33, 401, 5, 8, 90, 91, 92, 14, 15]},
           {"prompt_token_ids": [3, 4, 5, 6, 7]},
           {"prompt_token_ids": [250, 251, 252, 253, 254, 255, 256, 257, 258]}]


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["LlamaForCausalLM"], block_size=4, max_num_seqs=8,
               num_kv_blocks=256)


@pytest.mark.parametrize("kwargs,match", [
    (dict(beam_width=0), "beam_width must be an integer >= 1"),
    (dict(beam_width=2.5), "beam_width must be an integer >= 1"),
    (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(temperature=0.7), "temperature=0.7 is not supported by beam search"),
    (dict(early_stopping="sometimes"), "early_stopping must be True, False or 'never'"),
    (dict(length_penalty=float("nan")), "length_penalty must be a finite number"),
])
def test_bad_params_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kwargs})


def test_beam_width_above_max_num_seqs_is_refused(llm):
    with pytest.raises(ValueError, match=r"beam_width=9 is larger than max_num_seqs=8"):
        llm.beam_search(PROMPTS, BeamSearchParams(beam_width=9, max_tokens=4))


def test_speculative_decoding_is_refused(tiny_models):
    spec = LLM(tiny_models["LlamaForCausalLM"], block_size=4, num_kv_blocks=64,
               speculative_method="ngram", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="speculative decoding.*speculative_method='ngram'"):
        spec.beam_search(PROMPTS, BeamSearchParams(beam_width=2, max_tokens=4))


def test_a_bad_prompt_fails_before_anything_runs(llm):
    kv = llm.engine.kv_cache
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.beam_search([PROMPTS[0], {"prompt_token_ids": [1, 10**6]}],
                        BeamSearchParams(beam_width=2, max_tokens=4))
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.beam_search([{"prompt_token_ids": []}], BeamSearchParams(beam_width=2, max_tokens=4))
    assert not llm.engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks


def test_a_busy_engine_is_refused(llm):
    llm.engine.add_request({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2))
    try:
        with pytest.raises(RuntimeError, match="beam search runs alone"):
            llm.beam_search(PROMPTS, BeamSearchParams(beam_width=2, max_tokens=4))
    finally:
        while llm.engine.has_unfinished_requests():
            llm.engine.step()


@pytest.mark.parametrize("num_kv_blocks", [16, 8])
def test_preempted_beams_are_recomputed_to_the_same_result(tiny_models, llm, num_kv_blocks):
    """A cache too small for every beam at once (8 blocks: one beam's worth): beams are
    preempted and recomputed, and beams that have their logprobs give their blocks up to
    siblings that wait for them; the search gives what it gives with room to spare."""
    params = BeamSearchParams(beam_width=4, max_tokens=16, ignore_eos=True)
    expected = llm.beam_search(PROMPTS, params)
    tight = LLM(tiny_models["LlamaForCausalLM"], block_size=4, max_num_seqs=8,
                num_kv_blocks=num_kv_blocks)
    got = tight.beam_search(PROMPTS, params)
    assert tight.engine.scheduler.stats.num_preemptions > 0
    for out, exp in zip(got, expected, strict=True):
        assert [s.tokens for s in out.sequences] == [s.tokens for s in exp.sequences]
        assert [s.score for s in out.sequences] == pytest.approx(
            [s.score for s in exp.sequences], rel=1e-5, abs=1e-5)
    kv = tight.engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks


def test_a_failing_step_leaves_the_engine_clean(llm, monkeypatch):
    calls = []
    execute = llm.engine.executor.execute_model

    def failing(plan):
        calls.append(plan)
        output = execute(plan)
        if len(calls) == 3:
            raise RuntimeError("device fell over")
        return output

    monkeypatch.setattr(llm.engine.executor, "execute_model", failing)
    with pytest.raises(RuntimeError, match="device fell over"):
        llm.beam_search(PROMPTS, BeamSearchParams(beam_width=4, max_tokens=8))
    monkeypatch.undo()
    kv = llm.engine.kv_cache
    assert not llm.engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks
    # The runner forgets the aborted beams with the next step; the engine serves on.
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=3),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_lora_request_is_refused(llm):
    with pytest.raises(ValueError, match="lora_request: beam search runs the base model"):
        llm.beam_search(PROMPTS, BeamSearchParams(beam_width=2, max_tokens=4),
                        lora_request=object())


def test_progress_counts_finished_prompts(llm, monkeypatch):
    import hitchllm.entrypoints.llm as llm_module

    updates = []

    class Bar:
        def __init__(self, **kwargs):
            assert kwargs["total"] == len(PROMPTS)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n):
            updates.append(n)

    monkeypatch.setattr(llm_module, "tqdm", Bar)
    llm.beam_search(PROMPTS, BeamSearchParams(beam_width=2, max_tokens=4), use_tqdm=True)
    assert updates == [1] * len(PROMPTS)
