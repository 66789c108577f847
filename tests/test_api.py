"""The user-facing surface: LLM, SamplingParams, EngineConfig validation, chat, the CLI."""

from __future__ import annotations

import pytest
import torch
from reference import hf_model

from hitchllm import LLM, SamplingParams
from hitchllm.entrypoints.cli import main


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["LlamaForCausalLM"], block_size=4)


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_k": -3}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"n": 0}, "n must"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"stop": [""]}, "stop"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
])
def test_sampling_params_validation_says_what_to_change(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"dtype": "float8"}, "dtype"),
    ({"block_size": 0}, "block_size"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"kv_cache_memory": "lots"}, "kv_cache_memory|size"),
    ({"no_such_option": 1}, "no_such_option"),
])
def test_engine_config_validation(llama_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(llama_path, **kwargs)


def test_missing_model_directory_is_explained(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path / "nowhere"))


def test_max_model_len_beyond_the_model_is_refused(llama_path):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(llama_path, max_model_len=10_000)


def test_results_come_back_in_input_order_for_string_and_token_prompts(llm):
    tok = llm.get_tokenizer()
    prompts = ["def add(a, b):", {"prompt_token_ids": tok("Hello").input_ids}, "x" * 30]
    params = SamplingParams(max_tokens=6, temperature=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == ["def add(a, b):", None, "x" * 30]
    assert outs[1].prompt_token_ids == tok("Hello").input_ids
    alone = llm.generate(prompts[2], params, use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == outs[2].outputs[0].token_ids
    for out in outs:
        seq = out.outputs[0]
        assert seq.text == tok.decode(seq.token_ids, skip_special_tokens=True)


def test_per_prompt_sampling_params(llm):
    outs = llm.generate(["a", "b"], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=5)],
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 5]
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12)
    alone = llm.generate(["seeded"], params, use_tqdm=False)[0].outputs[0].token_ids
    crowd = llm.generate(["other", "seeded", "more text"],
                         [SamplingParams(temperature=1.0, max_tokens=12), params,
                          SamplingParams(temperature=0.7, max_tokens=3)], use_tqdm=False)
    assert crowd[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=12)
    assert llm.generate(["seeded"], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_stop_strings_and_stop_token_ids(llm):
    base = llm.generate(["stop here"], SamplingParams(max_tokens=12, temperature=0,
                                                      ignore_eos=True), use_tqdm=False)[0]
    text, ids = base.outputs[0].text, base.outputs[0].token_ids
    stop = text[3:6]
    assert stop
    out = llm.generate(["stop here"], SamplingParams(max_tokens=12, temperature=0, stop=stop,
                                                     ignore_eos=True), use_tqdm=False)[0]
    first = text.find(stop)
    assert out.outputs[0].text == text[:first]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop)
    kept = llm.generate(["stop here"], SamplingParams(
        max_tokens=12, temperature=0, stop=stop, include_stop_str_in_output=True,
        ignore_eos=True), use_tqdm=False)[0]
    assert kept.outputs[0].text == text[:first + len(stop)]

    out = llm.generate(["stop here"], SamplingParams(max_tokens=12, temperature=0,
                                                     stop_token_ids=[ids[4]], ignore_eos=True),
                       use_tqdm=False)[0]
    cut = ids.index(ids[4]) + 1
    assert out.outputs[0].token_ids == ids[:cut]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", ids[4])


def test_min_tokens_blocks_stop_tokens(llm):
    base = llm.generate(["x"], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0]
    first = base.outputs[0].token_ids[0]
    out = llm.generate(["x"], SamplingParams(max_tokens=6, temperature=0, min_tokens=3,
                                             stop_token_ids=[first]), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) >= 3
    assert first not in out.outputs[0].token_ids[:3]


def test_logprobs_match_transformers(llm, tiny_models):
    prompt = [5, 17, 99, 230]
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(max_tokens=3, temperature=0, logprobs=3, min_tokens=3),
                       use_tqdm=False)[0].outputs[0]
    model = hf_model(tiny_models["LlamaForCausalLM"])
    seq = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        ref = model(seq).logits[0].double().log_softmax(-1)
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + step]
        assert entry[token].rank == 1
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        top = row.topk(3).indices.tolist()
        assert list(entry)[: 1] == [token] and set(top) <= set(entry)


def test_chat_applies_the_template(llm):
    messages = [{"role": "user", "content": "Hi there"}]
    out = llm.chat(messages, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"]
    assert out.prompt_token_ids == list(expected)
    assert tok.decode(out.prompt_token_ids).endswith("<|im_start|>assistant\n")


def test_cli_generate_and_backends(llama_path, capsys):
    assert main(["generate", "--model", llama_path, "--prompt", "def f", "--max-tokens", "5",
                 "--block-size", "4"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("def f")
    assert main(["backends", "--model", llama_path]) == 0
    table = capsys.readouterr().out
    assert "TORCH" in table and "auto mode picks: TORCH" in table
    assert main(["generate", "--model", llama_path, "--prompt", "x", "--top-p", "0"]) == 2
    assert "top_p" in capsys.readouterr().err
