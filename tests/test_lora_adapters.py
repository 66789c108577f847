"""Adapter directories and requests that cannot be served are refused with a ValueError that
says what is wrong, nothing is queued and nothing leaks; and a request naming an adapter is
never served by the base model where LoRA is off or its plugin is missing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from hitchllm_lora import manager_for
from hitchllm_lora.adapter import LoRAAdapter
from hitchllm_lora.cache import AdapterCache
from lora_reference import write_adapter

from hitchllm import LLM, EngineConfig, LoRARequest, SamplingParams
from hitchllm.entrypoints.cli import build_parser, engine_kwargs
from hitchllm.tiny_model import build_tiny_checkpoint

PARAMS = SamplingParams(temperature=0.0, max_tokens=2)


@pytest.fixture(scope="module")
def base(tiny_models) -> str:
    return tiny_models["LlamaForCausalLM"]


@pytest.fixture(scope="module")
def good(base, tmp_path_factory) -> str:
    return write_adapter(base, tmp_path_factory.mktemp("good") / "a", 4, ["q_proj"], seed=3)


@pytest.fixture(scope="module")
def llm(base) -> LLM:
    return LLM(base, enable_lora=True, max_loras=2, max_lora_rank=8)


def bad_adapters(base: str, good: str, root: Path) -> dict[str, tuple[str, str]]:
    """name -> (directory, what the error must say)."""
    cases: dict[str, tuple[str, str]] = {}

    def copy(name: str) -> Path:
        path = root / name
        shutil.copytree(good, path)
        return path

    cases["no-directory"] = (str(root / "absent"), "no such directory")
    no_config = copy("no-config")
    (no_config / "adapter_config.json").unlink()
    cases["no-config"] = (str(no_config), "adapter_config.json is missing")
    bin_only = copy("bin-only")
    (bin_only / "adapter_model.safetensors").rename(bin_only / "adapter_model.bin")
    cases["bin-only"] = (str(bin_only), "re-save with safe_serialization=True")
    cases["rank"] = (write_adapter(base, root / "rank", 16, ["q_proj"]),
                     "rank 16 exceeds max_lora_rank=8")
    cases["lm-head"] = (write_adapter(base, root / "lm-head", 4, ["q_proj", "lm_head"]),
                        r"target modules \['lm_head'\] are not supported")
    cases["regex-embed"] = (write_adapter(base, root / "regex", 4, r".*embed_tokens"),
                            "embed_tokens.base_layer.weight' is not a lora_A/lora_B weight")
    cases["bias"] = (write_adapter(base, root / "bias", 4, ["q_proj"], bias="lora_only"),
                     "bias is 'lora_only'")
    cases["dora"] = (write_adapter(base, root / "dora", 4, ["v_proj"], use_dora=True), "DoRA")
    deeper = build_tiny_checkpoint(root / "deeper-model", num_hidden_layers=3)
    cases["deeper"] = (write_adapter(str(deeper), root / "deeper", 4, ["q_proj"]),
                       "model.layers.2.self_attn.q_proj', which this model lacks")
    wider = build_tiny_checkpoint(root / "wider-model", intermediate_size=96)
    cases["wider"] = (write_adapter(str(wider), root / "wider", 4, ["down_proj"]),
                      "down_proj does not fit this model")
    bad_json = copy("bad-json")
    (bad_json / "adapter_config.json").write_text("{not json")
    cases["bad-json"] = (str(bad_json), "not valid JSON")
    renamed = copy("renamed-tensor")
    config = json.loads((renamed / "adapter_config.json").read_text())
    (renamed / "adapter_config.json").write_text(json.dumps({**config, "r": 2}))
    cases["config-rank"] = (str(renamed), "says r=2")
    return cases


def test_bad_adapter_directories_are_refused_saying_why(llm, base, good, tmp_path):
    for name, (path, message) in bad_adapters(base, good, tmp_path).items():
        with pytest.raises(ValueError, match=message):
            llm.generate(["x", "y"], PARAMS, use_tqdm=False,
                         lora_request=[None, LoRARequest(name, 7, path)])
        assert not llm.engine.has_unfinished_requests(), name
    assert manager_for(llm.engine.config).adapter_names() == []
    assert llm.engine.kv_cache.usage == 0
    # The engine goes on serving.
    out = llm.generate("x", PARAMS, use_tqdm=False, lora_request=LoRARequest("ok", 1, good))
    assert len(out[0].outputs[0].token_ids) == 2


def test_requests_that_name_no_single_adapter_are_refused(llm, good, tmp_path):
    other = shutil.copytree(good, tmp_path / "other")
    llm.generate("x", PARAMS, use_tqdm=False, lora_request=LoRARequest("named", 3, good))
    cases = [
        (LoRARequest("named", 3, str(other)), "is loaded from .* unload it first"),
        (LoRARequest("never-loaded", 4), "not loaded and the request gives no lora_path"),
        (LoRARequest("zero-id", 0, good), "lora_int_id must be a positive integer"),
        (LoRARequest("", 5, good), "lora_name must be a non-empty string"),
        (SimpleNamespace(lora_name="duck", lora_int_id=1, lora_path=good),
         "must be a hitchllm.LoRARequest"),
    ]
    for lora, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate("x", PARAMS, use_tqdm=False, lora_request=lora)
    with pytest.raises(ValueError, match="got 1 lora requests for 2 prompts"):
        llm.generate(["x", "y"], PARAMS, use_tqdm=False, lora_request=[None])
    assert not llm.engine.has_unfinished_requests()
    # By name alone once loaded.
    by_name = llm.generate("x", PARAMS, use_tqdm=False, lora_request=LoRARequest("named", 3))
    assert len(by_name[0].outputs[0].token_ids) == 2


def test_run_time_add_and_remove(llm, good):
    manager = manager_for(llm.engine.config)
    bound = manager.add_adapter(LoRARequest("runtime", 9, good))
    assert bound == LoRARequest("runtime", 9, good)
    assert "runtime" in manager.adapter_names()
    assert manager.add_adapter(LoRARequest("runtime", 9)) == bound
    manager.remove_adapter("runtime")
    assert "runtime" not in manager.adapter_names()
    with pytest.raises(ValueError, match="'runtime' is not loaded; loaded:"):
        manager.remove_adapter("runtime")
    with pytest.raises(ValueError, match="not loaded and the request gives no lora_path"):
        llm.generate("x", PARAMS, use_tqdm=False, lora_request=LoRARequest("runtime", 9))


def test_adapter_refused_when_lora_is_off(base, good):
    llm = LLM(base)
    with pytest.raises(ValueError, match=r"LoRA is off.*enable_lora=True \(--enable-lora\).*"
                                         "hitchllm-lora"):
        llm.generate(["x", "y"], PARAMS, use_tqdm=False,
                     lora_request=[None, LoRARequest("a", 1, good)])
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="engine serves no LoRA adapters"):
        manager_for(llm.engine.config)


def test_enable_lora_without_the_plugin_is_refused(base, monkeypatch):
    monkeypatch.setenv("HITCHLLM_PLUGINS", "no-such-plugin")
    with pytest.raises(ValueError, match="needs the plugin hitchllm-lora, which is not "
                                         "installed: pip install hitchllm-lora"):
        LLM(base, enable_lora=True)


def test_lora_config_is_checked(base):
    with pytest.raises(ValueError, match="max_lora_rank, max_loras set but enable_lora is off"):
        EngineConfig(model=base, max_loras=2, max_lora_rank=8)
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) is below max_loras \(2\)"):
        EngineConfig(model=base, enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="max_loras"):
        EngineConfig(model=base, enable_lora=True, max_loras=0)
    config = EngineConfig(model=base, enable_lora=True, max_loras=3)
    assert config.cpu_lora_capacity == 3


def test_lora_flags_reach_the_engine_config(base):
    args = build_parser().parse_args(
        ["generate", "--model", base, "--prompt", "x", "--enable-lora", "--max-loras", "4",
         "--max-lora-rank", "32", "--max-cpu-loras", "8"])
    config = EngineConfig(**engine_kwargs(args))
    assert (config.enable_lora, config.max_loras, config.max_lora_rank,
            config.max_cpu_loras) == (True, 4, 32, 8)


def test_host_cache_evicts_the_least_recently_used_adapter():
    reads: list[str] = []

    def read(request: LoRARequest) -> LoRAAdapter:
        reads.append(request.lora_name)
        return LoRAAdapter(request, rank=1, scaling=1.0, weights={})

    cache = AdapterCache(capacity=2, read=read)
    a, b, c = (LoRARequest(n, i + 1, f"/adapters/{n}") for i, n in enumerate("abc"))
    # a used again after b: b is the least recently used
    a, b, a, c = (cache.add(request) for request in (a, b, a, c))  # bound to their loads
    assert cache.is_loaded(a) and cache.is_loaded(c) and not cache.is_loaded(b)
    assert cache.names() == ["a", "b", "c"]  # evicted from memory, still known by name
    cache.get(b)  # read again from its directory; now a is the least recently used
    assert reads == ["a", "b", "c", "b"] and not cache.is_loaded(a)
    assert cache.num_evictions == 2
