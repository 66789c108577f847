"""A mixed batch of requests for several PEFT adapters and the base model: each request's
greedy tokens equal PeftModel's with its adapter, its logprobs match PEFT's, and the base
rows equal the base model."""

from __future__ import annotations

import pytest
from lora_reference import assert_outputs_match_peft, peft_greedy, peft_model, write_adapter
from test_models_hf_parity import mixed_prompts

from hitchllm import LLM, LoRARequest, SamplingParams

MAX_NEW = 8
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, target modules, extra write_adapter arguments): different ranks and target
# sets, one with rslora scaling (alpha / sqrt(r)).
ADAPTERS = {
    "attn-qv": (4, r".*\.(q_proj|v_proj)", {}),  # PEFT's regex form of target_modules
    "all-rslora": (8, ALL_TARGETS, {"use_rslora": True}),
    "mlp-ko": (2, ["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], {"alpha": 9}),
}


@pytest.fixture(scope="module", params=["LlamaForCausalLM", "Qwen2ForCausalLM",
                                        "Qwen3ForCausalLM"])
def model_and_adapters(request, tiny_models, tmp_path_factory):
    base = tiny_models[request.param]
    root = tmp_path_factory.mktemp(f"adapters-{request.param}")
    paths = {}
    for seed, (name, (rank, targets, extra)) in enumerate(ADAPTERS.items()):
        paths[name] = write_adapter(base, root / name, rank, targets, seed=seed + 1, **extra)
    return base, paths


def greedy_with_logprobs() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=3)


def test_mixed_adapter_batch_matches_peft(model_and_adapters):
    base, paths = model_and_adapters
    names = [*paths, None, *paths, None]  # every adapter twice, and the base model
    prompts = mixed_prompts(7, lengths=(5, 17, 3, 9, 12, 1, 30, 6))
    requests = [None if n is None else LoRARequest(n, i + 1, paths[n])
                for i, n in enumerate(names)]
    llm = LLM(base, enable_lora=True, max_loras=len(paths), max_lora_rank=8, block_size=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy_with_logprobs(),
                        lora_request=requests, use_tqdm=False)

    assert_outputs_match_peft(base, paths, names, prompts, outs, MAX_NEW)
    assert llm.engine.kv_cache.usage == 0  # every block returned


def test_same_adapter_in_one_request_or_many_gives_the_same_logprobs(model_and_adapters):
    """A request's logits do not depend on its batch neighbours' adapters."""
    base, paths = model_and_adapters
    name = "all-rslora"
    lora = LoRARequest(name, 1, paths[name])
    prompt = {"prompt_token_ids": mixed_prompts(2, lengths=(11,))[0]}
    llm = LLM(base, enable_lora=True, max_loras=3, max_lora_rank=8)
    alone = llm.generate([prompt], greedy_with_logprobs(), lora_request=lora, use_tqdm=False)[0]
    others = [LoRARequest(n, i + 2, p) for i, (n, p) in enumerate(paths.items()) if n != name]
    mixed = llm.generate([prompt] * 3, greedy_with_logprobs(), use_tqdm=False,
                         lora_request=[others[0], lora, others[1]])[1]
    assert mixed.outputs[0].token_ids == alone.outputs[0].token_ids
    for a, b in zip(alone.outputs[0].logprobs, mixed.outputs[0].logprobs):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].logprob == pytest.approx(b[k].logprob, abs=1e-5)


def test_chat_takes_a_lora_request(model_and_adapters):
    base, paths = model_and_adapters
    llm = LLM(base, enable_lora=True, max_lora_rank=8)
    conversation = [{"role": "user", "content": "hello"}]
    lora = LoRARequest("attn-qv", 1, paths["attn-qv"])
    params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4)
    chat = llm.chat(conversation, params, use_tqdm=False, lora_request=lora)[0]
    ids = chat.prompt_token_ids
    generated = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False,
                             lora_request=lora)[0]
    assert chat.outputs[0].token_ids == generated.outputs[0].token_ids
    assert chat.outputs[0].token_ids == peft_greedy(peft_model(base, paths["attn-qv"]), ids, 4)


@pytest.mark.gpu
def test_mixed_adapter_decode_under_cuda_graphs_matches_peft(tiny_models, tmp_path):
    """On CUDA (TRITON_ATTN, bfloat16, the grouped Triton LoRA kernels), decode steps replay
    graphs captured before any adapter was active: they read the pools and the per-token
    slots written in place. Graph runs equal eager runs of the same engine exactly, with
    adapters swapping through two slots; every adapter changes the output, and the first
    tokens agree with PEFT's float32 model (bfloat16 may break later near-ties)."""
    base = tiny_models["LlamaForCausalLM"]
    paths = {name: write_adapter(base, tmp_path / name, rank, targets, seed=i + 1, **extra)
             for i, (name, (rank, targets, extra)) in enumerate(ADAPTERS.items())}
    names = [*paths, None, *paths]
    prompts = mixed_prompts(4, lengths=(5, 17, 3, 9, 12, 1, 30))
    loras = [None if n is None else LoRARequest(n, i + 1, paths[n]) for i, n in enumerate(names)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)

    def generate(eager: bool, with_lora: bool = True) -> tuple[list[list[int]], list[int]]:
        llm = LLM(base, device="cuda", dtype="bfloat16", attention_backend="TRITON_ATTN",
                  enable_lora=True, max_loras=2, max_lora_rank=8, enforce_eager=eager,
                  gpu_memory_utilization=0.3)
        graphs = llm.engine.executor.runner.graphs
        replays: list[int] = []
        replay = graphs.replay
        graphs.replay = lambda size, q=1: replays.append(size) or replay(size, q)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            lora_request=loras if with_lora else None, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], replays

    graphed, replays = generate(eager=False)
    assert replays
    eager, no_replays = generate(eager=True)
    assert not no_replays
    assert graphed == eager
    without, _ = generate(eager=False, with_lora=False)
    for name, prompt, got, plain in zip(names, prompts, graphed, without):
        model = peft_model(base, None if name is None else paths[name])
        assert got[:1] == peft_greedy(model, prompt, 1), name
        assert (got == plain) == (name is None), name
