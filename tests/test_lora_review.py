"""Review of the multi-LoRA plugin: the corners where adapters meet the rest of the engine
(unload and reload, abort, parallel sampling, prompt logprobs, speculative decoding), each
against PEFT, the engine's own output without the feature, or the block pool's counters."""

from __future__ import annotations

import shutil

import pytest
from hitchllm_lora import manager_for
from lora_reference import peft_greedy, peft_logprobs, peft_model, write_adapter
from test_models_hf_parity import mixed_prompts

from hitchllm import LLM, EngineConfig, LoRARequest, SamplingParams
from hitchllm.engine.llm_engine import LLMEngine

MAX_NEW = 5


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory):
    base = tiny_models["LlamaForCausalLM"]
    root = tmp_path_factory.mktemp("review-adapters")
    targets = [["q_proj", "v_proj", "down_proj"], ["o_proj", "up_proj", "k_proj"]]
    paths = {f"ad{i}": write_adapter(base, root / f"ad{i}", 4, t, seed=20 + i)
             for i, t in enumerate(targets)}
    return base, paths


def greedy(length: int = MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=length, min_tokens=length, **kw)


def generate(llm: LLM, prompt: list[int], lora: LoRARequest | None, n: int = MAX_NEW, **kw):
    return llm.generate({"prompt_token_ids": prompt}, greedy(n, **kw), lora_request=lora,
                        use_tqdm=False)[0]


def tokens_of(llm: LLM, prompt: list[int], lora: LoRARequest | None, n: int = MAX_NEW,
              **kw) -> list[int]:
    return generate(llm, prompt, lora, n, **kw).outputs[0].token_ids


def test_reloading_a_name_from_a_rewritten_directory_serves_the_new_weights(adapters,
                                                                             tmp_path):
    """Unload an adapter, retrain it in place (same name, same directory), load it again:
    requests must run with the new weights, neither the old device slot nor KV blocks
    computed under the old weights."""
    base, paths = adapters
    path = tmp_path / "tenant"
    shutil.copytree(paths["ad0"], path)
    llm = LLM(base, enable_lora=True, max_loras=1, max_lora_rank=4, block_size=4)
    prompt = mixed_prompts(4, lengths=(13,))[0]
    lora = LoRARequest("tenant", 1, str(path))
    assert tokens_of(llm, prompt, lora) == peft_greedy(peft_model(base, paths["ad0"]), prompt,
                                                       MAX_NEW)
    llm.engine.remove_lora("tenant")
    shutil.rmtree(path)
    shutil.copytree(paths["ad1"], path)
    llm.engine.add_lora(lora)
    out = generate(llm, prompt, lora)
    assert out.outputs[0].token_ids == peft_greedy(peft_model(base, paths["ad1"]), prompt,
                                                   MAX_NEW)
    assert out.num_cached_tokens == 0  # the old load's blocks are not this load's
    assert generate(llm, prompt, lora).num_cached_tokens == 12  # its own blocks are
    assert llm.engine.kv_cache.usage == 0


def test_abort_of_the_request_holding_the_only_slot_lets_another_adapter_run(adapters):
    base, paths = adapters
    llm = LLM(base, enable_lora=True, max_loras=1, max_lora_rank=4)
    engine = llm.engine
    prompts = mixed_prompts(5, lengths=(6, 7))
    holder = engine.add_request({"prompt_token_ids": prompts[0]}, greedy(50),
                                lora_request=LoRARequest("ad0", 1, paths["ad0"]))
    other = engine.add_request({"prompt_token_ids": prompts[1]}, greedy(),
                               lora_request=LoRARequest("ad1", 2, paths["ad1"]))
    engine.step()
    assert [r.request_id for r in engine.scheduler.waiting] == [other]  # gated
    engine.abort_request(holder)
    assert not manager_for(engine.config).gate.running  # the abort released the slot
    tokens = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == other and out.finished:
                tokens = out.outputs[0].token_ids
    assert tokens == peft_greedy(peft_model(base, paths["ad1"]), prompts[1], MAX_NEW)
    assert engine.kv_cache.usage == 0


def test_parallel_sampling_children_all_run_with_the_adapter(adapters):
    base, paths = adapters
    llm = LLM(base, enable_lora=True, max_loras=1, max_lora_rank=4)
    prompt = mixed_prompts(6, lengths=(9,))[0]
    lora = LoRARequest("ad1", 2, paths["ad1"])
    out = llm.generate({"prompt_token_ids": prompt}, greedy(MAX_NEW, n=3), lora_request=lora,
                       use_tqdm=False)[0]
    expected = peft_greedy(peft_model(base, paths["ad1"]), prompt, MAX_NEW)
    assert [c.token_ids for c in out.outputs] == [expected] * 3
    assert llm.engine.kv_cache.usage == 0


def test_prompt_logprobs_use_the_adapter(adapters):
    base, paths = adapters
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=4)
    prompt = mixed_prompts(7, lengths=(8,))[0]
    oracle = peft_model(base, paths["ad0"])
    # Twice: the second run could otherwise take the first's prefix-cache blocks.
    for _ in range(2):
        out = generate(llm, prompt, LoRARequest("ad0", 1, paths["ad0"]), 1, prompt_logprobs=0)
        expected = peft_logprobs(oracle, prompt[:1], prompt[1:])
        for i, entry in enumerate(out.prompt_logprobs[1:]):
            token = prompt[i + 1]
            assert entry[token].logprob == pytest.approx(expected[i, token].item(), abs=2e-4)


def test_speculation_verifies_drafts_with_the_adapter(adapters):
    """Greedy output with ngram or draft-model drafts equals the output without
    speculation, adapter by adapter (the verification forward must apply each request's
    adapter to its drafts)."""
    base, paths = adapters
    motif = mixed_prompts(8, lengths=(5,))[0]
    prompts = [motif * 4, (motif[::-1] * 4)[:17], motif * 3]
    loras = [LoRARequest("ad0", 1, paths["ad0"]), None, LoRARequest("ad1", 2, paths["ad1"])]
    n = 12

    def run(**spec) -> tuple[list[list[int]], LLM]:
        llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=4, **spec)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(n),
                            lora_request=loras, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm

    plain, _ = run()
    speculated, llm = run(speculative_method="ngram", num_speculative_tokens=3)
    assert llm.engine.stats().spec_decode_num_accepted_tokens > 0  # drafts were accepted
    assert speculated == plain
    # A draft model (the base model itself: it drafts without the adapters).
    drafted, llm = run(speculative_method="draft_model", speculative_model=base,
                       num_speculative_tokens=2)
    assert llm.engine.stats().spec_decode_num_draft_tokens > 0
    assert drafted == plain
    for prompt, lora, tokens in zip(prompts, loras, plain):
        oracle = peft_model(base, None if lora is None else lora.lora_path)
        assert tokens == peft_greedy(oracle, prompt, n)


def test_an_adapter_gone_from_disk_before_it_runs_fails_only_its_requests(adapters, tmp_path):
    """An accepted request whose adapter left host memory and whose directory was deleted
    before it ran ends with an error; the others come out right; no block leaks."""
    base, paths = adapters
    gone = tmp_path / "gone"
    shutil.copytree(paths["ad0"], gone)
    llm = LLM(base, enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=4)
    engine = llm.engine
    prompts = mixed_prompts(9, lengths=(5, 6, 7))
    loras = [LoRARequest("gone", 1, str(gone)), LoRARequest("ad1", 2, paths["ad1"]), None]
    ids = [engine.add_request({"prompt_token_ids": p}, greedy(), lora_request=lora)
           for p, lora in zip(prompts, loras)]
    engine.add_lora(LoRARequest("ad0", 3, paths["ad0"]))  # "gone" leaves host memory
    shutil.rmtree(gone)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    assert outs[ids[0]].outputs[0].finish_reason == "error"
    for rid, prompt, lora in zip(ids[1:], prompts[1:], loras[1:]):
        oracle = peft_model(base, None if lora is None else lora.lora_path)
        assert outs[rid].outputs[0].token_ids == peft_greedy(oracle, prompt, MAX_NEW)
    assert engine.kv_cache.usage == 0
    assert not manager_for(engine.config).gate.running


def test_a_request_for_a_known_adapter_reads_no_files_when_added(adapters):
    """Adding a request runs on the engine's thread: an adapter already known (checked
    when it was loaded) is not read again from disk then, even when it has left host
    memory; it is read once, when it is put into a device slot."""
    base, paths = adapters
    llm = LLM(base, enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=4)
    engine = llm.engine
    cache = manager_for(engine.config).cache
    for i, name in enumerate(paths):
        engine.add_lora(LoRARequest(name, i + 1, paths[name]))
    assert cache.num_reads == 2  # ad0 was evicted by ad1
    prompt = mixed_prompts(10, lengths=(6,))[0]
    for lora in (LoRARequest("ad0", 1), LoRARequest("ad0", 1, paths["ad0"])):
        engine.add_request({"prompt_token_ids": prompt}, greedy(), lora_request=lora)
    assert cache.num_reads == 2
    outs = llm.generate({"prompt_token_ids": prompt}, greedy(), use_tqdm=False,
                        lora_request=LoRARequest("ad0", 1))
    assert cache.num_reads == 3  # once, for the slot
    assert outs[0].outputs[0].token_ids == peft_greedy(peft_model(base, paths["ad0"]), prompt,
                                                       MAX_NEW)


def test_chunked_prefills_of_interleaved_adapters_through_one_slot(adapters):
    """Prompts longer than the step budget are prefilled over several steps while requests
    of another adapter and of the base model wait or run beside them; one slot."""
    base, paths = adapters
    llm = LLM(base, enable_lora=True, max_loras=1, max_lora_rank=4,
              max_num_batched_tokens=8, max_num_seqs=4)
    names = ["ad0", None, "ad1", "ad0", None, "ad1"]
    prompts = mixed_prompts(11, lengths=(19, 11, 23, 9, 17, 13))
    loras = [None if n is None else LoRARequest(n, int(n[-1]) + 1, paths[n]) for n in names]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False,
                        lora_request=loras)
    oracles = {n: peft_model(base, paths.get(n)) for n in set(names)}
    for name, prompt, out in zip(names, prompts, outs):
        assert out.outputs[0].token_ids == peft_greedy(oracles[name], prompt, MAX_NEW), name
    assert llm.engine.kv_cache.usage == 0


def test_unloading_an_adapter_lets_its_running_and_waiting_requests_finish(adapters):
    base, paths = adapters
    llm = LLM(base, enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=4)
    engine = llm.engine
    prompts = mixed_prompts(12, lengths=(7, 9, 5))
    names = ["ad0", "ad1", "ad0"]
    ids = [engine.add_request({"prompt_token_ids": p}, greedy(),
                              lora_request=LoRARequest(n, int(n[-1]) + 1, paths[n]))
           for p, n in zip(prompts, names)]
    engine.step()  # the ad0 requests run, the ad1 one waits for the slot
    engine.remove_lora("ad0")
    engine.remove_lora("ad1")
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
    for rid, prompt, name in zip(ids, prompts, names):
        assert outs[rid] == peft_greedy(peft_model(base, paths[name]), prompt, MAX_NEW), name
    assert engine.list_loras() == []
    assert engine.kv_cache.usage == 0
    with pytest.raises(ValueError, match="not loaded"):
        engine.add_request({"prompt_token_ids": prompts[0]}, greedy(),
                           lora_request=LoRARequest("ad0", 1))


def test_adapter_on_some_layers_only(adapters, tmp_path):
    """PEFT's layers_to_transform: only the named decoder layers are adapted."""
    base, _ = adapters
    path = write_adapter(base, tmp_path / "layer1", 4, ["q_proj", "down_proj"], seed=5,
                         layers_to_transform=[1])
    llm = LLM(base, enable_lora=True, max_lora_rank=4)
    prompt = mixed_prompts(13, lengths=(10,))[0]
    tokens = tokens_of(llm, prompt, LoRARequest("layer1", 1, path))
    assert tokens == peft_greedy(peft_model(base, path), prompt, MAX_NEW)
    assert tokens != peft_greedy(peft_model(base, None), prompt, MAX_NEW)


def test_overlapped_steps_swap_the_slot_between_adapters(adapters):
    """With async scheduling (no min_tokens, so steps overlap) requests of different lengths
    finish while the next step is in flight and the one slot passes to the next adapter."""
    base, paths = adapters
    llm = LLM(base, enable_lora=True, max_loras=1, max_lora_rank=4, async_scheduling=True)
    names = ["ad0", "ad1", None, "ad0", "ad1"]
    lengths = [3, 6, 4, 7, 2]
    prompts = mixed_prompts(14, lengths=(5, 8, 6, 4, 9))
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    loras = [None if n is None else LoRARequest(n, int(n[-1]) + 1, paths[n]) for n in names]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=loras)
    assert llm.engine._overlap
    oracles = {n: peft_model(base, paths.get(n)) for n in set(names)}
    for name, prompt, n, out in zip(names, prompts, lengths, outs):
        assert out.outputs[0].token_ids == peft_greedy(oracles[name], prompt, n), name
    assert manager_for(llm.engine.config).slots.num_activations >= 2
    assert llm.engine.kv_cache.usage == 0


def test_an_unload_racing_a_request_by_name_stays_unloaded(adapters):
    """The server unloads an adapter while the engine thread accepts a request naming it
    (the unload lands between the request's lookup and its binding): the request is
    refused and the adapter stays unloaded, not loaded back by the request."""
    base, paths = adapters
    llm = LLM(base, enable_lora=True, max_lora_rank=4)
    llm.engine.add_lora(LoRARequest("ad0", 1, paths["ad0"]))
    cache = manager_for(llm.engine.config).cache
    lookup = cache._bind

    def unload_meanwhile(request: LoRARequest):
        bound = lookup(request)
        if cache.names():
            cache.remove(request.lora_name)
        return bound

    cache._bind = unload_meanwhile
    with pytest.raises(ValueError, match="'ad0' is not loaded"):
        llm.engine.add_request({"prompt_token_ids": [5, 6, 7]}, greedy(),
                               lora_request=LoRARequest("ad0", 1))
    assert llm.engine.list_loras() == []
    assert not llm.engine.has_unfinished_requests()


def test_two_engines_built_from_one_config_keep_their_own_adapters(adapters):
    base, paths = adapters
    config = EngineConfig(model=base, enable_lora=True, max_lora_rank=4)
    first, second = LLMEngine(config), LLMEngine(config)
    first.add_lora(LoRARequest("ad0", 1, paths["ad0"]))
    assert [a.lora_name for a in first.list_loras()] == ["ad0"]
    assert second.list_loras() == []
