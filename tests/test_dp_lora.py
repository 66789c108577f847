"""LoRA adapters on a data-parallel server (2 replicas): every replica loads each adapter,
at start-up (``--lora-modules``) and at run time (``/v1/load_lora_adapter``), so a request
for an adapter gives the offline engine's text whichever replica serves it; unloading and a
refused load leave no replica holding the adapter."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest
from lora_reference import write_adapter
from server_process import running_server, scrape

from hitchllm import LLM, LoRARequest, SamplingParams

BASE = "tiny"
MAX_NEW = 8
PROMPT = "def add(a, b):"
ROUTED = "hitchllm:data_parallel_requests_routed_total"


@pytest.fixture(scope="module")
def adapters(llama_path, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("dp-adapters")
    paths = {"ad0": write_adapter(llama_path, root / "ad0", 4, ["q_proj", "v_proj"], seed=30),
             "ad1": write_adapter(llama_path, root / "ad1", 4, ["o_proj", "up_proj"], seed=31)}
    (root / "empty").mkdir()
    paths["empty"] = str(root / "empty")
    return paths


@pytest.fixture(scope="module")
def server(llama_path, adapters):
    args = [llama_path, "--served-model-name", BASE, "-dp", "2", "--block-size", "4",
            "--max-model-len", "256", "--enable-lora", "--max-lora-rank", "4",
            "--lora-modules", f"ad0={adapters['ad0']}"]
    with running_server(args, timeout=240,
                        env={"HITCHLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(llama_path):
    return LLM(llama_path, enable_lora=True, block_size=4, max_model_len=256, max_lora_rank=4)


def post(url: str, body: dict[str, Any]) -> tuple[int, str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def offline_text(offline: LLM, lora: LoRARequest) -> str:
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    [out] = offline.generate([PROMPT], params, lora_request=lora, use_tqdm=False)
    return out.outputs[0].text


def texts_on_both_replicas(server: str, client: openai.OpenAI, model: str) -> set[str]:
    """The answers of two requests in a row (the replicas take turns), after checking that
    each replica served one."""
    before = [scrape(server, ROUTED, f'replica="{i}"') for i in range(2)]
    answers = {client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_NEW,
                                         temperature=0, extra_body={"ignore_eos": True}
                                         ).choices[0].text for _ in range(2)}
    assert [scrape(server, ROUTED, f'replica="{i}"') - b for i, b in enumerate(before)] == [1, 1]
    return answers


def test_adapters_load_on_every_replica(server, client, offline, adapters):
    assert [m.id for m in client.models.list().data] == [BASE, "ad0"]
    want = offline_text(offline, LoRARequest("ad0", 1, adapters["ad0"]))
    assert texts_on_both_replicas(server, client, "ad0") == {want}

    status, body = post(f"{server}/v1/load_lora_adapter",
                        {"lora_name": "ad1", "lora_path": adapters["ad1"]})
    assert status == 200, body
    assert [m.id for m in client.models.list().data] == [BASE, "ad0", "ad1"]
    want = offline_text(offline, LoRARequest("ad1", 2, adapters["ad1"]))
    assert texts_on_both_replicas(server, client, "ad1") == {want}

    status, body = post(f"{server}/v1/unload_lora_adapter", {"lora_name": "ad1"})
    assert status == 200, body
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="ad1", prompt=PROMPT, max_tokens=2)


def test_a_refused_adapter_is_on_no_replica(server, client, adapters):
    status, body = post(f"{server}/v1/load_lora_adapter",
                        {"lora_name": "bad", "lora_path": adapters["empty"]})
    assert status == 400 and "adapter_config.json" in body
    assert "bad" not in [m.id for m in client.models.list().data]
    # No replica kept the name: loading a good adapter under it works everywhere.
    status, body = post(f"{server}/v1/load_lora_adapter",
                        {"lora_name": "bad", "lora_path": adapters["ad0"]})
    assert status == 200, body
    assert len(texts_on_both_replicas(server, client, "bad")) == 1
