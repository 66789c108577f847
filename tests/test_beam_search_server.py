"""``/v1/completions`` with vLLM's ``use_beam_search`` (``n`` is the beam width): the choices
are the offline ``LLM.beam_search`` beams, best first; options beam search cannot honour are
a 400 naming them; a search waits for running requests, and requests arriving during a search
wait for it."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient

from hitchllm import LLM, BeamSearchParams
from hitchllm.config import EngineConfig
from hitchllm.engine.async_engine import AsyncLLMEngine
from hitchllm.engine.llm_engine import LLMEngine
from hitchllm.entrypoints.openai.metrics import ServerMetrics
from hitchllm.entrypoints.openai.server import build_app
from hitchllm.sampling_params import SamplingParams

MODEL = "tiny"
ARGS = dict(block_size=4, max_model_len=128, max_num_seqs=8, num_kv_blocks=128)


@pytest.fixture(scope="module", params=["engine-thread", "engine-process"])
def http(llama_path, request):
    """The app over an engine stepping in a thread of this process, and over one engine
    process (``hitchllm serve``'s default), where a search is a call answered by its
    result."""
    config = EngineConfig(model=llama_path, attention_backend="TORCH", **ARGS)
    if request.param == "engine-process":
        from transformers import AutoTokenizer

        from hitchllm.data_parallel.client import DataParallelEngine

        client: Any = DataParallelEngine(config, 1, MODEL, start_timeout_s=120)
        app = build_app(client, [MODEL], AutoTokenizer.from_pretrained(llama_path),
                        client.metrics)
    else:
        engine = LLMEngine(config)
        client = AsyncLLMEngine(engine)
        app = build_app(client, [MODEL], engine.tokenizer, ServerMetrics(MODEL))
    with TestClient(app, raise_server_exceptions=False) as http_client:
        yield http_client
    client.shutdown()


@pytest.fixture(scope="module")
def offline(llama_path):
    return LLM(llama_path, **ARGS)


def _complete(http, **body):
    return http.post("/v1/completions", json={"model": MODEL, "use_beam_search": True,
                                              "temperature": 0, **body})


def test_choices_are_the_offline_beams_best_first(http, offline):
    prompts = ["def add(a, b):", "The quick brown fox"]
    r = _complete(http, prompt=prompts, n=3, max_tokens=10, length_penalty=0.8)
    assert r.status_code == 200, r.text
    body = r.json()
    expected = offline.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=10,
                                                             length_penalty=0.8))
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == list(range(6))
    assert [c["text"] for c in choices] == [s.text for o in expected for s in o.sequences]
    assert [c["finish_reason"] for c in choices] == [
        s.finish_reason for o in expected for s in o.sequences]
    assert body["usage"]["completion_tokens"] == sum(
        len(s.output_token_ids) for o in expected for s in o.sequences)
    assert body["usage"]["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in expected)
    scores = [s.score for s in expected[0].sequences]
    assert scores == sorted(scores, reverse=True)


def test_token_id_prompts_and_ignore_eos(http, offline):
    r = _complete(http, prompt=[5, 6, 7, 8], n=2, max_tokens=6, ignore_eos=True)
    assert r.status_code == 200, r.text
    [expected] = offline.beam_search({"prompt_token_ids": [5, 6, 7, 8]},
                                     BeamSearchParams(beam_width=2, max_tokens=6,
                                                      ignore_eos=True))
    assert [c["text"] for c in r.json()["choices"]] == [s.text for s in expected.sequences]


@pytest.mark.parametrize("body,param,match", [
    (dict(stream=True), "stream", "stream cannot be used with use_beam_search"),
    (dict(logprobs=2), "logprobs", "logprobs cannot be used with use_beam_search"),
    (dict(temperature=0.7), "temperature", "temperature must be 0"),
    (dict(n=9), None, "beam_width=9 is larger than max_num_seqs=8"),
    (dict(use_beam_search=False, length_penalty=0.5), "length_penalty", "not supported"),
])
def test_options_beam_search_cannot_honour_are_400(http, body, param, match):
    r = _complete(http, **{"prompt": "x", "max_tokens": 4, "n": 2, **body})
    assert r.status_code == 400
    error = r.json()["error"]
    assert match in error["message"]
    assert error["param"] == param


def test_chat_has_no_beam_search(http):
    r = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2,
        "use_beam_search": True})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "use_beam_search"


def test_an_engine_client_without_beam_search_is_a_clear_error(llama_path):
    """An ``EngineClient`` without ``beam_search`` refuses it by name."""
    from hitchllm.entrypoints.openai.protocol import CompletionRequest
    from hitchllm.entrypoints.openai.serving import OpenAIServing

    class Replicas:
        max_model_len = 128

    from transformers import AutoTokenizer

    serving = OpenAIServing(Replicas(), MODEL, AutoTokenizer.from_pretrained(llama_path), None)
    req = CompletionRequest(model=MODEL, prompt="x", n=2, use_beam_search=True)
    with pytest.raises(ValueError, match="use_beam_search is not available on this server"):
        asyncio.run(serving.completions(req))


def test_a_search_waits_for_running_requests_and_requests_wait_for_it(http):
    results = {}

    def long_request():
        results["long"] = http.post("/v1/completions", json={
            "model": MODEL, "prompt": "hello", "max_tokens": 60, "ignore_eos": True})

    def search():
        results["search"] = _complete(http, prompt="def add(a, b):", n=4, max_tokens=12)

    def late_request():
        results["late"] = http.post("/v1/completions", json={
            "model": MODEL, "prompt": "x", "max_tokens": 3, "ignore_eos": True})

    threads = [threading.Thread(target=f) for f in (long_request, search, late_request)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert {k: r.status_code for k, r in results.items()} == {
        "long": 200, "search": 200, "late": 200}
    assert len(results["search"].json()["choices"]) == 4
    assert results["long"].json()["usage"]["completion_tokens"] == 60
    assert results["late"].json()["usage"]["completion_tokens"] == 3


def test_engine_thread_order_search_after_running_requests_before_later_ones(llama_path):
    """A search starts once the request running before it has finished; a request sent after
    it is held until it is done; a held request that is aborted ends at once."""
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=llama_path, attention_backend="TORCH",
                                                   **ARGS)))
    times: dict[str, float] = {}

    async def generate(name, max_tokens, request_id=None):
        outs = [o async for o in engine.generate(
            {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=max_tokens,
                                                            ignore_eos=True),
            request_id=request_id)]
        times[name] = time.monotonic()
        return outs[-1]

    async def search():
        out = await engine.beam_search([{"prompt_token_ids": [4, 5, 6]}],
                                       BeamSearchParams(beam_width=4, max_tokens=12))
        times["search"] = time.monotonic()
        return out

    async def main():
        long = asyncio.create_task(generate("long", 40))
        await asyncio.sleep(0)
        searched = asyncio.create_task(search())
        await asyncio.sleep(0)
        late = asyncio.create_task(generate("late", 3))
        held = asyncio.create_task(generate("held", 3, request_id="held"))
        await asyncio.sleep(0)
        engine.abort("held")
        return await asyncio.gather(long, searched, late, held)

    try:
        long, [found], late, held = asyncio.run(asyncio.wait_for(main(), timeout=60))
    finally:
        engine.shutdown()
    assert len(long.outputs[0].token_ids) == 40 and len(late.outputs[0].token_ids) == 3
    assert len(found.sequences) == 4
    assert held.outputs[0].finish_reason == "abort" and held.outputs[0].token_ids == []
    assert times["long"] <= times["search"] <= times["late"]
    assert times["held"] <= times["search"]
