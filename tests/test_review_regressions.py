"""Regression tests for bugs found in review: request ids, multi-token steps with stop strings
and partial characters, extra EOS ids, the priority policy, parameter validation."""

from __future__ import annotations

import json
import math
import shutil

import pytest
from fake_dists import install_fake_plugin
from test_models_hf_parity import greedy, mixed_prompts, run
from test_speculative import PROPOSERS

from hitchllm import LLM, SamplingParams
from hitchllm.engine.detokenizer import IncrementalDetokenizer


def test_child_ids_never_collide_with_live_requests(llama_path):
    llm = LLM(llama_path)
    engine = llm.engine
    engine.add_request("x", SamplingParams(max_tokens=3), request_id="0_a")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("y", SamplingParams(max_tokens=3, n=2), request_id="a")
    engine.add_request("z", SamplingParams(max_tokens=3), request_id="0")
    auto = engine.add_request("w", SamplingParams(max_tokens=3))
    assert auto not in ("0", "0_a")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_cache.usage == 0.0


def test_stop_string_inside_accepted_drafts_cuts_tokens_and_logprobs(
    tmp_path, monkeypatch, llama_path
):
    install_fake_plugin(tmp_path / "site", monkeypatch, "hitchllm-fake-specdec", "0.1",
                        "fake_specdec_plugin", PROPOSERS)
    import fake_specdec_plugin

    prompt = mixed_prompts(13, lengths=(6,))[0]
    plain = LLM(llama_path)
    full = plain.generate([{"prompt_token_ids": prompt}], greedy(20), use_tqdm=False)[0]
    text = full.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    fake_specdec_plugin.ORACLE[tuple(prompt)] = full.outputs[0].token_ids
    params = SamplingParams(temperature=0, max_tokens=20, stop=stop, logprobs=1, ignore_eos=True)
    expected = plain.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    spec = LLM(llama_path, speculative_method="oracle", num_speculative_tokens=5)
    got = spec.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert got.outputs[0].text == expected.outputs[0].text
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    assert len(got.outputs[0].logprobs) == len(expected.outputs[0].token_ids)
    assert got.outputs[0].finish_reason == "stop"


def test_flush_emits_text_held_for_an_incomplete_character(llama_path):
    tok = LLM(llama_path).get_tokenizer()
    ids = tok("hello 世界", add_special_tokens=False).input_ids
    assert len(ids) > 3
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    for t in ids[:-1]:  # stop in the middle of the last character's bytes
        detok.add_token(t)
    detok.flush()
    assert detok.text == tok.decode(ids[:-1])
    assert detok.text.startswith("hello 世")


def test_extra_eos_ids_from_generation_config_stop_generation(tmp_path, llama_path):
    model = tmp_path / "m"
    shutil.copytree(llama_path, model)
    prompt = mixed_prompts(14, lengths=(5,))[0]
    base = run(LLM(str(model)), [prompt], max_tokens=8)[0]
    end_of_turn = base[2]
    gen = json.loads((model / "generation_config.json").read_text())
    gen["eos_token_id"] = [gen["eos_token_id"], end_of_turn]
    (model / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(str(model))
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0,
                                                                      max_tokens=8),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base[: base.index(end_of_turn) + 1]
    assert out.finish_reason == "stop"
    ignoring = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert ignoring.token_ids == base


def test_priority_policy_serves_urgent_requests_first_and_keeps_tokens(llama_path):
    prompts = mixed_prompts(15, lengths=(20, 30, 25, 9))
    expected = run(LLM(llama_path, block_size=4), prompts)
    llm = LLM(llama_path, block_size=4, num_kv_blocks=14, max_num_seqs=2,
              scheduling_policy="priority")
    engine = llm.engine
    order = []
    for i, (p, prio) in enumerate(zip(prompts, [5, 5, 0, 1])):
        engine.add_request({"prompt_token_ids": p}, greedy(), request_id=str(i), priority=prio)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                order.append(o.request_id)
                outs[o.request_id] = o.outputs[0].token_ids
    assert [outs[str(i)] for i in range(4)] == expected
    assert order[:2] == ["2", "3"]
    assert engine.kv_cache.usage == 0.0


@pytest.mark.parametrize("kwargs", [{"temperature": math.nan}, {"top_p": math.inf},
                                    {"stop": "x", "detokenize": False}])
def test_more_invalid_sampling_params(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
