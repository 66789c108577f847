"""``hitchllm serve --kv-role producer`` and ``--kv-role consumer`` (shared-memory connector)
behind ``hitchllm serve-disagg``, three processes on localhost, checked against one ordinary
engine (an in-process app) and through the instances' ``/metrics``. Every request has a
timeout, and every process is stopped when the module ends."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import openai
import pytest
from server_process import in_process_server, running_server, running_server_process, scrape

from hitchllm.entrypoints.disagg_router import prefill_body

MODEL = "tiny"
ENGINE_ARGS = ["--block-size", "4", "--max-model-len", "256", "--served-model-name", MODEL]
PROMPTS = ["def add(a, b):", "The quick brown fox", "import numpy as np\n"]
CHATS = [[{"role": "user", "content": "Hi!"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]]
COMPUTED = "hitchllm:prompt_tokens_computed_total"
LOADS = "hitchllm:kv_transfer_loads_total"
FALLBACKS = "hitchllm:kv_transfer_load_fallbacks_total"
SAVES = "hitchllm:kv_transfer_saves_total"


@contextmanager
def running_router(prefill: str, decode: str, timeout: float = 60.0) -> Iterator[str]:
    args = ["--prefill", prefill, "--decode", decode, "--timeout-s", "60"]
    with running_server_process(args, timeout, command="serve-disagg") as (url, _):
        yield url


@pytest.fixture(scope="module")
def instances(llama_path, tmp_path_factory):
    """(router, producer, consumer) URLs."""
    shm = str(tmp_path_factory.mktemp("kv"))
    with running_server([llama_path, *ENGINE_ARGS, "--kv-role", "producer", "--kv-connector",
                         "shared_memory", "--kv-connector-extra-config",
                         json.dumps({"path": shm})], timeout=180) as producer, \
         running_server([llama_path, *ENGINE_ARGS, "--kv-role", "consumer", "--kv-connector",
                         "shared_memory", "--kv-load-timeout-s", "2"], timeout=180) as consumer, \
         running_router(producer, consumer) as router:
        yield router, producer, consumer


@pytest.fixture(scope="module")
def reference(llama_path):
    """One ordinary engine behind the same server code, in this process."""
    with in_process_server(llama_path, MODEL) as http:
        yield http


def sse_text(chunks, chat: bool) -> str:
    if chat:
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def test_routed_greedy_answers_equal_one_instance_streaming_or_not_without_recompute(
    instances, reference
):
    router, producer, consumer = instances
    client = openai.OpenAI(base_url=f"{router}/v1", api_key="none", max_retries=0, timeout=60)
    computed, loads = scrape(consumer, COMPUTED), scrape(consumer, LOADS)
    saves = scrape(producer, SAVES)
    body = {"model": MODEL, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    extra = {"ignore_eos": True}
    num_requests = 0
    for prompt in PROMPTS:
        want = reference.post("/v1/completions", json={**body, "prompt": prompt}).json()
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10,
                                        temperature=0, extra_body=extra)
        assert got.choices[0].text == want["choices"][0]["text"]
        assert got.usage.completion_tokens == 10
        chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10,
                                           temperature=0, stream=True, extra_body=extra)
        assert sse_text(chunks, chat=False) == got.choices[0].text
        num_requests += 2
    for messages in CHATS:
        want = reference.post("/v1/chat/completions",
                              json={**body, "messages": messages}).json()
        got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                             temperature=0, extra_body=extra)
        assert got.choices[0].message.content == want["choices"][0]["message"]["content"]
        chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                                temperature=0, stream=True, extra_body=extra)
        assert sse_text(chunks, chat=True) == got.choices[0].message.content
        num_requests += 2
    # The decode instance loaded every prompt's KV and computed only each last prompt token.
    assert scrape(consumer, LOADS) - loads == num_requests
    assert scrape(consumer, COMPUTED) - computed == num_requests
    assert scrape(consumer, "hitchllm:kv_transfer_load_bytes_total") > 0
    # The producer saved every prompt (it reports a save once its engine has stepped again).
    deadline = time.monotonic() + 10
    while scrape(producer, SAVES) - saves < num_requests:
        assert time.monotonic() < deadline, "the producer did not report every save"
        time.sleep(0.1)
    assert scrape(producer, SAVES) - saves == num_requests


def test_the_producer_answers_with_the_params_a_consumer_needs(instances, reference):
    _, producer, consumer = instances
    request = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
               "ignore_eos": True}
    answer = _post(producer, "/v1/completions", prefill_body(request))
    params = answer["kv_transfer_params"]
    assert params["kv_connector"] == "shared_memory" and params["block_size"] == 4
    assert answer["usage"]["completion_tokens"] == 1
    got = _post(consumer, "/v1/completions", {**request, "kv_transfer_params": params})
    want = reference.post("/v1/completions", json=request).json()
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert "kv_transfer_params" not in got


def test_a_consumer_whose_kv_never_comes_computes_the_prompt_after_its_timeout(
    instances, reference
):
    _, producer, consumer = instances
    request = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0,
               "ignore_eos": True}
    params = _post(producer, "/v1/completions", prefill_body(request))["kv_transfer_params"]
    fallbacks = scrape(consumer, FALLBACKS)
    lost = {**params, "remote_request_id": "lost-on-the-way"}
    start = time.monotonic()
    got = _post(consumer, "/v1/completions", {**request, "kv_transfer_params": lost})
    assert time.monotonic() - start >= 2  # --kv-load-timeout-s
    want = reference.post("/v1/completions", json=request).json()
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert scrape(consumer, FALLBACKS) - fallbacks == 1


def test_a_client_that_leaves_the_router_aborts_its_decode_and_frees_its_blocks(instances):
    router, _, consumer = instances
    abort = 'finished_reason="abort"'

    def aborted() -> float:
        try:
            return scrape(consumer, "hitchllm:request_success_total", abort)
        except KeyError:  # none aborted yet
            return 0.0

    before = aborted()
    body = json.dumps({"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 240,
                       "ignore_eos": True, "stream": True}).encode()
    request = urllib.request.Request(f"{router}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        r.readline()  # the first chunk: the decode runs
    deadline = time.monotonic() + 20
    while aborted() == before:
        assert time.monotonic() < deadline, "the decode request was not aborted"
        time.sleep(0.1)
    assert scrape(consumer, "hitchllm:num_requests_running") == 0
    assert scrape(consumer, "hitchllm:kv_cache_usage_perc") == 0


def _post(url: str, path: str, body: object) -> dict:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_the_router_passes_an_instances_error_to_the_client(instances):
    router, _, _ = instances
    request = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": -1.0}
    with pytest.raises(urllib.error.HTTPError) as err:
        _post(router, "/v1/completions", request)
    assert err.value.code == 400
    assert "temperature" in json.loads(err.value.read())["error"]["message"]
    with pytest.raises(urllib.error.HTTPError) as err:
        _post(router, "/v1/completions", [1, 2])
    assert err.value.code == 400
