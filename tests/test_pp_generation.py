"""Pipeline parallelism on the CPU (gloo, one worker process per stage) generates what one
process does.

Models: the bundled Llama (8 layers, 4 per stage; a tied LM head, so the last stage loads its
own copy of the embedding) with every kind of sampling, and a tiny 3-layer Qwen3 (one KV head,
tied head, a vocabulary of 515 rows) split unevenly (2 + 1) under preemption and chunked
prefill. Greedy rows are also checked against Hugging Face transformers, an independent
reference."""

from __future__ import annotations

import os
import time

import pytest
from reference import hf_greedy
from test_tp_generation import assert_logprobs_close
from tp_support import TP_TEST_TIMEOUT_S, only_builtin_plugins, tp_llm  # noqa: F401

from hitchllm import LLM, SamplingParams
from hitchllm.bundled_model import default_model_path
from hitchllm.tiny_model import build_tiny_checkpoint

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 47)), [300, 7, 7, 7, 9, 12, 200, 5, 1], [40, 41, 42]]
MAX_TOKENS = 10
# fp32, chunked prefill (the 37-token prompt takes three steps).
ENGINE = dict(dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=96,
              max_num_batched_tokens=16)


def params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        # Prompt logprobs run the LM head over prompt positions (on the last stage).
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=2),
        # The last stage samples with the engine's seeded generators, as one process does.
        SamplingParams(temperature=1.0, top_k=50, seed=7, max_tokens=MAX_TOKENS,
                       ignore_eos=True, logprobs=2),
        # A penalty and logits processors read the output so far: the last stage's request
        # states must hold every earlier token.
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                       repetition_penalty=1.3, logit_bias={7: 30.0}, bad_words=["engine"]),
    ]


def generate(llm: LLM, prompts=PROMPTS, sampling=None):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling or params(),
                        use_tqdm=False)
    return ([o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs],
            [o.prompt_logprobs for o in outs])


def test_pp2_generates_what_pp1_generates(only_builtin_plugins):  # noqa: F811
    path = default_model_path()
    tokens1, logprobs1, prompt_logprobs1 = generate(LLM(path, **ENGINE))
    start = time.monotonic()
    with tp_llm(path, pipeline_parallel_size=2, **ENGINE) as llm:
        # Each stage caches only its layers (the bundled model's 8 split 4 + 4).
        assert len(llm.engine.executor.kv_cache_specs) == 4
        assert not llm.engine._overlap  # the driver feeds each step's tokens to stage 0
        # The start-up steps (run on CUDA): every stage runs them, its forward sending to the
        # next stage's, and they change no request's tokens.
        llm.engine.executor.warm_up()
        tokens2, logprobs2, prompt_logprobs2 = generate(llm)
    assert time.monotonic() - start < TP_TEST_TIMEOUT_S
    assert tokens2 == tokens1
    assert all(len(t) == MAX_TOKENS for t in tokens2)
    assert 7 in tokens2[3]  # the logit bias bites on the last stage
    for a, b in zip(logprobs1 + prompt_logprobs1, logprobs2 + prompt_logprobs2):
        assert_logprobs_close(a, b)
    assert tokens2[:2] == hf_greedy(path, PROMPTS[:2], MAX_TOKENS)


def test_pp_with_an_uneven_split_under_preemption_and_chunked_prefill(
        tmp_path, only_builtin_plugins):  # noqa: F811
    """A Qwen3 of 3 layers over 2 stages (2 + 1; a tied head on stage 1). A KV cache of 16
    blocks (64 tokens) for prompts and outputs of 94 tokens: requests are preempted and
    resumed (every stage drops and rebuilds their state from the plan), and prompts longer
    than the 16-token budget are chunked."""
    path = str(build_tiny_checkpoint(
        tmp_path / "m", "Qwen3ForCausalLM", num_hidden_layers=3, num_key_value_heads=1,
        vocab_size=515, tie_word_embeddings=True))
    engine = dict(ENGINE, num_kv_blocks=16, max_model_len=64)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True)
    sampling = [greedy, greedy, seeded, greedy]
    one = LLM(path, **engine)
    expected = generate(one, sampling=sampling)[0]
    assert one.engine.stats().num_preemptions > 0
    with tp_llm(path, pipeline_parallel_size=2, **engine) as llm:
        assert len(llm.engine.executor.kv_cache_specs) == 2  # the larger stage sizes a block
        got = generate(llm, sampling=sampling)[0]
        assert llm.engine.stats().num_preemptions > 0
    assert got == expected
    assert got[1] == hf_greedy(path, [PROMPTS[1]], MAX_TOKENS)[0]


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("HITCHLLM_SLOW_TESTS"),
                    reason="4 CPU worker processes take about 35 s on CI's 2 cores; set "
                           "HITCHLLM_SLOW_TESTS=1 to run (docs/distributed.md)")
def test_tp2_pp2_generates_what_one_process_generates(llama_path,
                                                      only_builtin_plugins):  # noqa: F811
    tokens1 = generate(LLM(llama_path, **ENGINE))[0]
    with tp_llm(llama_path, tensor_parallel_size=2, pipeline_parallel_size=2, **ENGINE) as llm:
        assert llm.engine.executor.pids and len(llm.engine.executor.pids) == 4
        assert generate(llm)[0] == tokens1
