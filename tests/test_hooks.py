"""The quantization, LoRA and model-load hooks are called where they plug in."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fake_dists import install_fake_plugin
from test_models_hf_parity import greedy, mixed_prompts

from hitchllm import LLM

PLUGIN = """
from hitchllm import hookimpl

CALLS = []


class HalfScale:
    '''A toy method that only records its calls: every linear layer asks it for a linear
    method while the model is built, before the engine reports the model loaded; None leaves
    the layer unquantized.'''

    def __init__(self, model_config):
        CALLS.append(("quant_init", model_config.architecture))

    def get_linear_method(self, layer, prefix):
        CALLS.append(("get_linear_method", prefix))
        return None


@hookimpl
def hitchllm_quantization_methods():
    return {"halfscale": HalfScale}


@hookimpl
def hitchllm_model_loaded(model, engine_config):
    CALLS.append(("model_loaded", engine_config.model))


@hookimpl
def hitchllm_request_added(request):
    lora = request.lora_request
    if lora is not None and lora.lora_name == "missing":
        raise ValueError("adapter 'missing' not found: pass an existing adapter path")
    CALLS.append(("request_added", request.request_id))


@hookimpl
def hitchllm_before_forward(requests, num_scheduled_tokens):
    CALLS.append(("before_forward", [r.lora_name for r in requests], list(num_scheduled_tokens)))


@hookimpl
def hitchllm_block_hash_extra_keys(request):
    return None if request.lora_name is None else ("adapter", request.lora_name)
"""


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    # Distributed as the LoRA plugin, so that an engine with enable_lora accepts it as the one
    # that serves adapters (the request tests load only this plugin, not the real one).
    install_fake_plugin(tmp_path / "site", monkeypatch, "hitchllm-lora", "0.1",
                        "fake_hooks_plugin", PLUGIN)
    import fake_hooks_plugin

    fake_hooks_plugin.CALLS.clear()
    return fake_hooks_plugin


def test_quantization_method_is_asked_per_layer_before_load(plugin, llama_path):
    LLM(llama_path, quantization="halfscale")
    kinds = [c[0] for c in plugin.CALLS]
    asked = [c[1] for c in plugin.CALLS if c[0] == "get_linear_method"]
    assert kinds[0] == "quant_init" and kinds[len(asked) + 1] == "model_loaded"
    assert asked[:4] == ["model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj",
                         "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj"]
    assert asked[-1] == "lm_head"


def test_unknown_quantization_method_lists_installed(plugin, llama_path):
    # The quantization plugin's own methods (fp8, ...) are listed too.
    with pytest.raises(ValueError, match="'int3'.*installed: .*halfscale"):
        LLM(llama_path, quantization="int3")


def test_request_hooks_route_adapters_and_separate_prefix_cache(plugin, llama_path,
                                                                 monkeypatch):
    monkeypatch.setenv("HITCHLLM_PLUGINS", "fake_hooks_plugin")
    llm = LLM(llama_path, block_size=4, enable_lora=True)
    prompt = {"prompt_token_ids": mixed_prompts(3, lengths=(20,))[0]}
    a = SimpleNamespace(lora_name="a")
    b = SimpleNamespace(lora_name="b")
    llm.generate([prompt], greedy(4), lora_request=a, use_tqdm=False)
    same = llm.generate([prompt], greedy(4), lora_request=a, use_tqdm=False)[0]
    other = llm.generate([prompt], greedy(4), lora_request=b, use_tqdm=False)[0]
    assert same.num_cached_tokens == 16  # same adapter: cached blocks are shared
    assert other.num_cached_tokens == 0  # another adapter never reuses them
    forwards = [c for c in plugin.CALLS if c[0] == "before_forward"]
    assert forwards[0] == ("before_forward", ["a"], [20])
    assert ("before_forward", ["b"], [20]) in forwards


def test_request_rejected_by_a_plugin_is_not_queued(plugin, llama_path, monkeypatch):
    monkeypatch.setenv("HITCHLLM_PLUGINS", "fake_hooks_plugin")
    llm = LLM(llama_path, enable_lora=True)
    with pytest.raises(ValueError, match="adapter 'missing'"):
        llm.generate(["x", "y"], greedy(2), use_tqdm=False,
                     lora_request=[None, SimpleNamespace(lora_name="missing")])
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate(["x"], greedy(2), use_tqdm=False)[0].outputs[0].token_ids) == 2
