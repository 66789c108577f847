"""LoRA adapters on the OpenAI-compatible server, driven by the official ``openai`` client:
adapters are models of their own names (``--lora-modules``, ``/v1/load_lora_adapter``),
their completions equal offline generation with the adapter, bad adapters and unknown names
get 400/404 saying what is wrong, and ``/metrics`` names the running and waiting adapters."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import openai
import pytest
from lora_reference import write_adapter
from safetensors.torch import load_file, save_file
from server_process import running_server, scrape

from hitchllm import LLM, LoRARequest, SamplingParams
from hitchllm.entrypoints.cli import parse_lora_modules
from hitchllm.entrypoints.openai.api_server import _check_lora_modules
from hitchllm.entrypoints.openai.models import (
    APIError,
    LoadLoRAAdapterRequest,
    ServedModels,
    runtime_lora_updating_allowed,
)

BASE = "tiny"
MAX_NEW = 8
ENGINE = {"block_size": 4, "max_model_len": 256, "max_lora_rank": 4}


@pytest.fixture(scope="module")
def adapters(llama_path, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("server-adapters")
    targets = {"ad0": ["q_proj", "v_proj"], "ad1": ["gate_proj", "down_proj"],
               "ad2": ["o_proj", "up_proj"]}
    paths = {name: write_adapter(llama_path, root / name, 4, t, seed=20 + i)
             for i, (name, t) in enumerate(targets.items())}
    # Bad directories: nothing in it; rank above max_lora_rank; a module the model lacks.
    (root / "empty").mkdir()
    paths["empty"] = str(root / "empty")
    paths["rank8"] = write_adapter(llama_path, root / "rank8", 8, ["q_proj"], seed=5)
    foreign = Path(write_adapter(llama_path, root / "foreign", 4, ["q_proj"], seed=6))
    weights = load_file(foreign / "adapter_model.safetensors")
    save_file({k.replace(".layers.0.", ".layers.99."): v for k, v in weights.items()},
              str(foreign / "adapter_model.safetensors"))
    paths["foreign"] = str(foreign)
    return paths


@pytest.fixture(scope="module")
def server(llama_path, adapters):
    args = ["--model", llama_path, "--served-model-name", BASE, "--block-size", "4",
            "--max-model-len", "256", "--enable-lora", "--max-loras", "1",
            "--max-lora-rank", "4", "--max-cpu-loras", "2",
            "--lora-modules", f"ad0={adapters['ad0']}",
            json.dumps({"name": "ad1", "path": adapters["ad1"]})]
    with running_server(args, env={"HITCHLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(llama_path):
    return LLM(llama_path, enable_lora=True, **ENGINE)


def post(url: str, body: dict[str, Any]) -> tuple[int, str]:
    """POST JSON; the status and the body text, errors included."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def error_of(body: str) -> dict[str, Any]:
    return json.loads(body)["error"]


def offline_text(offline: LLM, prompt: str, lora: LoRARequest | None) -> str:
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    [out] = offline.generate([prompt], params, lora_request=lora, use_tqdm=False)
    return out.outputs[0].text


def served_text(client: openai.OpenAI, model: str, prompt: str) -> str:
    resp = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_NEW,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert resp.model == model
    return resp.choices[0].text


def test_adapters_are_models_with_the_base_as_parent(client):
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == [BASE, "ad0", "ad1"]
    assert cards[BASE].model_extra["parent"] is None
    assert {cards[n].model_extra["parent"] for n in ("ad0", "ad1")} == {BASE}
    assert client.models.retrieve("ad1").id == "ad1"


def test_model_name_selects_the_adapter_like_offline_generate(client, offline, adapters):
    prompt = "def add(a, b):"
    base = served_text(client, BASE, prompt)
    assert base == offline_text(offline, prompt, None)
    for i, name in enumerate(("ad0", "ad1"), start=1):
        got = served_text(client, name, prompt)
        assert got == offline_text(offline, prompt, LoRARequest(name, i, adapters[name]))
        assert got != base
    chunks = list(client.completions.create(model="ad0", prompt=prompt, max_tokens=MAX_NEW,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert {c.model for c in chunks} == {"ad0"}
    assert "".join(c.choices[0].text for c in chunks if c.choices) == served_text(
        client, "ad0", prompt)
    messages = [{"role": "user", "content": "Hi!"}]
    chat = client.chat.completions.create(model="ad1", messages=messages, temperature=0,
                                          max_completion_tokens=MAX_NEW,
                                          extra_body={"ignore_eos": True})
    [expected] = offline.chat(messages, SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                       ignore_eos=True),
                              lora_request=LoRARequest("ad1", 2, adapters["ad1"]),
                              use_tqdm=False)
    assert chat.model == "ad1"
    assert chat.choices[0].message.content == expected.outputs[0].text


def test_unknown_model_is_404_naming_adapters_too(client, server):
    with pytest.raises(openai.NotFoundError) as err:
        served_text(client, "ad9", "x")
    message = err.value.body["message"]
    assert "`ad9` does not exist" in message and "tiny, ad0, ad1" in message
    status, body = post(f"{server}/v1/chat/completions",
                        {"model": "ad9", "messages": [{"role": "user", "content": "x"}]})
    assert status == 404 and error_of(body)["param"] == "model"
    # Adapters share the base model's tokenizer.
    assert post(f"{server}/tokenize", {"model": "ad0", "prompt": "a b"})[0] == 200
    assert post(f"{server}/tokenize", {"model": "ad9", "prompt": "a b"})[0] == 404


def test_running_and_waiting_adapters_in_metrics(client, server):
    """max_loras=1: two long requests of different adapters, one runs while the other
    waits, and the info gauge says so; the counters count the loads and activations."""
    seen: set[tuple[str, str]] = set()
    threads = [threading.Thread(target=client.completions.create, kwargs=dict(
        model=name, prompt="a b c", max_tokens=200, temperature=0,
        extra_body={"ignore_eos": True})) for name in ("ad0", "ad1")]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        seen |= set(lora_info(server))
        time.sleep(0.02)
    assert {("ad0", "ad1"), ("ad1", "ad0")} & seen, seen
    assert lora_info(server) == [("", "")]
    assert scrape(server, "hitchllm:lora_adapter_loads_total") >= 2
    assert scrape(server, "hitchllm:lora_adapter_activations_total") >= 2
    scrape(server, "hitchllm:lora_adapter_evictions_total")  # exported, whatever its value


def lora_info(url: str) -> list[tuple[str, str]]:
    """(running, waiting) label values of ``hitchllm:lora_requests_info``'s series."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        text = r.read().decode()
    found = []
    for line in text.splitlines():
        if line.startswith("hitchllm:lora_requests_info{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            assert labels["max_lora"] == "1"
            found.append((labels["running_lora_adapters"], labels["waiting_lora_adapters"]))
    return found


def test_load_and_unload_at_run_time(client, server, offline, adapters):
    status, body = post(f"{server}/v1/load_lora_adapter",
                        {"lora_name": "ad2", "lora_path": adapters["ad2"]})
    assert status == 200 and "ad2" in body
    assert "ad2" in [m.id for m in client.models.list().data]
    prompt = "import os"
    assert served_text(client, "ad2", prompt) == offline_text(
        offline, prompt, LoRARequest("ad2", 3, adapters["ad2"]))
    status, body = post(f"{server}/v1/load_lora_adapter",
                        {"lora_name": "ad2", "lora_path": adapters["ad0"]})
    assert status == 400 and "already loaded" in error_of(body)["message"]

    status, body = post(f"{server}/v1/unload_lora_adapter", {"lora_name": "ad2"})
    assert status == 200
    assert "ad2" not in [m.id for m in client.models.list().data]
    with pytest.raises(openai.NotFoundError, match="ad2"):
        served_text(client, "ad2", prompt)
    status, body = post(f"{server}/v1/unload_lora_adapter", {"lora_name": "ad2"})
    assert status == 404
    assert "'ad2' is not loaded" in (msg := error_of(body)["message"]) and "ad0" in msg
    # The other adapters and the base model are untouched.
    assert served_text(client, "ad0", prompt) == offline_text(
        offline, prompt, LoRARequest("ad0", 1, adapters["ad0"]))


@pytest.mark.parametrize(("bad", "says"), [
    ("empty", "adapter_config.json is missing"),
    ("rank8", "rank 8 exceeds max_lora_rank=4"),
    ("foreign", "which this model lacks"),
    ("nowhere", "no such directory"),
])
def test_bad_adapter_directory_is_400_saying_what_is_wrong(client, server, adapters, bad, says):
    path = adapters.get(bad, "/nonexistent/adapter")
    status, body = post(f"{server}/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": path})
    assert status == 400
    assert says in error_of(body)["message"] and error_of(body)["param"] == "lora_path"
    assert "bad" not in [m.id for m in client.models.list().data]


def test_load_request_fields_are_checked(server):
    status, body = post(f"{server}/v1/load_lora_adapter", {"lora_name": "x"})
    assert status == 400 and "lora_path" in error_of(body)["message"]
    status, body = post(f"{server}/v1/load_lora_adapter",
                        {"lora_name": BASE, "lora_path": "/x"})
    assert status == 400 and "base model" in error_of(body)["message"]


# ---- without a server: the guards, the command line, the log --------------------------

def fake_engine(enable_lora: bool) -> Any:
    return SimpleNamespace(config=SimpleNamespace(enable_lora=enable_lora))


def test_loading_needs_enable_lora_then_the_runtime_switch():
    load = LoadLoRAAdapterRequest(lora_name="a", lora_path="/x")
    with pytest.raises(APIError, match="--enable-lora") as err:
        asyncio.run(ServedModels(fake_engine(False), [BASE], True).load(load))
    assert err.value.status == 400
    with pytest.raises(APIError, match="HITCHLLM_ALLOW_RUNTIME_LORA_UPDATING=1") as err:
        asyncio.run(ServedModels(fake_engine(True), [BASE], False).load(load))
    assert err.value.status == 404
    assert runtime_lora_updating_allowed({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    assert not runtime_lora_updating_allowed({"HITCHLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"})


def test_server_load_and_unload_log(offline, adapters, caplog):
    served = ServedModels(offline.engine, [BASE], allow_runtime_lora_updating=True)
    with caplog.at_level(logging.INFO):
        asyncio.run(served.load(LoadLoRAAdapterRequest(lora_name="logged",
                                                       lora_path=adapters["ad2"])))
        assert "logged" in [a.lora_name for a in offline.engine.list_loras()]
        asyncio.run(served.unload(SimpleNamespace(lora_name="logged")))
    text = caplog.text
    assert "loaded LoRA adapter 'logged'" in text and "/v1/load_lora_adapter" in text
    assert "unloaded LoRA adapter 'logged' through /v1/unload_lora_adapter" in text
    assert "logged" not in [a.lora_name for a in offline.engine.list_loras()]
    stats = offline.engine.stats()  # what /metrics reads, offline
    assert stats.lora.num_loads >= 1  # "logged" at least
    assert stats.running_lora_adapters == stats.waiting_lora_adapters == ()


def test_lora_modules_syntax():
    got = parse_lora_modules(["a=/p/a", '{"name": "b", "path": "/p/b", "base_model_name": "m"}'])
    assert got == [LoRARequest("a", 1, "/p/a"), LoRARequest("b", 2, "/p/b")]
    for bad, says in (("a", "NAME=PATH"), ("=/p", "both a name and a path"),
                      ('{"name": "b"}', '"name" and "path"'), ("{bad", "not valid JSON")):
        with pytest.raises(ValueError, match=re.escape(says)):
            parse_lora_modules([bad])
    config = SimpleNamespace(enable_lora=False)
    with pytest.raises(ValueError, match="needs --enable-lora"):
        _check_lora_modules(config, [BASE], got)
    with pytest.raises(ValueError, match="'tiny' is used twice"):
        _check_lora_modules(SimpleNamespace(enable_lora=True), [BASE],
                            [LoRARequest(BASE, 1, "/p")])
