"""No request can kill or stall the server: each bad request gets its own error, the engine
keeps serving (same greedy tokens, KV cache back to empty), /health tells the truth, limits
hold, and error bodies leak nothing internal."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.error
import urllib.request

import openai
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_process import running_server, scrape

from hitchllm import SamplingParams
from hitchllm.config import EngineConfig
from hitchllm.engine.async_engine import AsyncLLMEngine
from hitchllm.engine.llm_engine import LLMEngine
from hitchllm.entrypoints.openai.metrics import ServerMetrics
from hitchllm.entrypoints.openai.server import ServerLimits, build_app

KEY = "fault-key"
MODEL = "tiny"
MAX_BYTES = 200_000


@pytest.fixture(scope="module")
def server(llama_path):
    args = ["--model", llama_path, "--served-model-name", MODEL, "--api-key", KEY,
            "--block-size", "4",
            "--max-model-len", "512", "--max-n", "8", "--max-request-bytes", str(MAX_BYTES)]
    with running_server(args) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


def greedy_text(client, prompt: str = "def add(a, b):") -> str:
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    return resp.choices[0].text


def post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {KEY}", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# Each of these once killed the engine loop, after which every request got 503.
KILLERS = [
    {"seed": 2**64}, {"seed": -(2**63) - 1}, {"seed": 2**64 - 1, "n": 2},
    {"top_p": 1e-300, "temperature": 1.0},
    {"repetition_penalty": 1e-46, "top_p": 0.5, "temperature": 1.0},
    {"temperature": 1e39}, {"top_k": 2**70, "temperature": 1.0}, {"logprobs": 10**6},
]
# Extreme but computable: each must complete.
SURVIVORS = [
    {"seed": 2**64 - 1}, {"seed": -(2**63)}, {"top_p": 1e-30, "temperature": 1.0},
    {"repetition_penalty": 1e-30, "top_p": 0.5, "temperature": 1.0},
    {"repetition_penalty": 1e30, "temperature": 1.0}, {"temperature": 2e-5, "top_p": 0.9},
]


def test_killer_parameters_get_400_and_the_engine_keeps_serving(server, client):
    before = greedy_text(client)
    url = f"{server}/v1/completions"
    for extra in KILLERS:
        body = {"model": MODEL, "prompt": "x = 1", "max_tokens": 4, **extra}
        status, payload = post(url, json.dumps(body).encode())
        assert status == 400, (extra, payload)
        assert payload["error"]["type"] == "BadRequestError"
    for extra in SURVIVORS:
        body = {"model": MODEL, "prompt": "x = 1", "max_tokens": 4, "ignore_eos": True, **extra}
        status, payload = post(url, json.dumps(body).encode())
        assert status == 200, (extra, payload)
        assert payload["usage"]["completion_tokens"] == 4
    assert greedy_text(client) == before
    with urllib.request.urlopen(f"{server}/health", timeout=5) as r:
        assert r.status == 200
    assert scrape(server, "hitchllm:kv_cache_usage_perc") == 0.0


def test_n_above_the_limit_is_400(client):
    with pytest.raises(openai.BadRequestError, match="n must be at most 8"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=9)


def test_large_bodies_get_413_announced_or_chunked(server):
    url = f"{server}/v1/completions"
    big = json.dumps({"model": MODEL, "prompt": "a" * MAX_BYTES, "max_tokens": 1}).encode()
    status, payload = post(url, big)
    assert status == 413 and "--max-request-bytes" in payload["error"]["message"]

    def chunks():
        for i in range(0, len(big), 65536):
            yield big[i : i + 65536]

    req = urllib.request.Request(url, data=chunks(), method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {KEY}",
        "Transfer-Encoding": "chunked"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=60)
    assert err.value.code == 413


def test_long_prompt_is_rejected_without_stalling_a_stream(server, client):
    aclient = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)

    async def stream() -> list[str | None]:
        chunks = await aclient.completions.create(
            model=MODEL, prompt="def f(x):", max_tokens=200, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        return [c.choices[0].finish_reason async for c in chunks]

    async def long_prompt() -> str:
        await asyncio.sleep(0.3)
        try:  # just under the body limit; far more tokens than max_model_len
            await aclient.completions.create(model=MODEL, prompt="ab " * 60_000, max_tokens=1)
        except openai.BadRequestError as exc:
            return str(exc)
        return "accepted"

    async def main():
        return await asyncio.gather(stream(), long_prompt())

    reasons, rejected = asyncio.run(main())
    assert "max_model_len" in rejected
    assert reasons[-1] == "length"


def num_aborted(server: str) -> float:
    try:
        return scrape(server, "hitchllm:request_success_total", 'finished_reason="abort"')
    except KeyError:  # no request was aborted yet
        return 0.0


def test_client_gone_aborts_a_non_streaming_request(server):
    aborted = num_aborted(server)
    body = json.dumps({"model": MODEL, "prompt": "def f(x):", "max_tokens": 500, "n": 8,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", int(server.rsplit(":", 1)[1]))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  b"Content-Type: application/json\r\nAuthorization: Bearer " + KEY.encode()
                  + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(0.5)
    deadline = time.monotonic() + 20
    while num_aborted(server) == aborted:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.2)
    # Far fewer than 8 x 500 tokens were generated.
    assert scrape(server, "hitchllm:num_requests_running") == 0


def test_host_header_cannot_bypass_the_api_key(server):
    port = int(server.rsplit(":", 1)[1])
    for host in (b"localhost#", b"localhost/x?", b"a:b@localhost"):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: " + host + b"\r\nConnection: close"
                      b"\r\n\r\n")
            reply = s.recv(4096).decode(errors="replace")
        status = int(reply.split()[1])
        assert status in (400, 401), (host, reply[:200])


def test_lone_surrogates_get_a_json_400(server):
    for path, body in [
        ("/v1/completions", '{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}'),
        ("/v1/chat/completions",
         '{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}'),
    ]:
        status, payload = post(f"{server}{path}", body.encode())
        assert status == 400, payload
        assert "Unicode" in payload["error"]["message"]


# ---- in-process: faults that need access to the engine ------------------------------------

TEMPLATE = ("{% for m in messages %}{% if loop.index0 % 2 == 0 and m['role'] != 'user' %}"
            "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
            "{% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")


@pytest.fixture
def app_engine(llama_path):
    engine = LLMEngine(EngineConfig(model=llama_path, block_size=4, max_model_len=128,
                                    attention_backend="TORCH"))
    async_engine = AsyncLLMEngine(engine)
    app = build_app(async_engine, [MODEL], engine.tokenizer, ServerMetrics(MODEL),
                    chat_template=TEMPLATE, limits=ServerLimits(max_n=4))
    with TestClient(app, raise_server_exceptions=False) as http:
        yield http, async_engine
    async_engine.shutdown()


def test_chat_template_errors_are_400(app_engine):
    http, _ = app_engine
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": "assistant", "content": "hi"}]})
    assert r.status_code == 400
    assert "roles must alternate" in r.json()["error"]["message"]


def test_a_request_the_engine_fails_gets_500_and_others_go_on(app_engine, monkeypatch):
    http, async_engine = app_engine
    runner = async_engine.engine.executor.runner
    original = runner._generator_for

    def generator_for(request):
        if request.sampling_params.seed == 13:
            raise RuntimeError("secret internal detail")
        return original(request)

    monkeypatch.setattr(runner, "_generator_for", generator_for)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3,
                                           "seed": 13})
    assert r.status_code == 500
    assert "secret" not in r.text and "RuntimeError" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3,
                                           "seed": 14, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert http.get("/health").status_code == 200


def test_health_is_503_once_the_engine_loop_is_dead(app_engine, monkeypatch):
    http, async_engine = app_engine
    assert http.get("/health").status_code == 200

    def broken():
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(async_engine.engine, "has_unfinished_requests", broken)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3})
    assert r.status_code == 503 and "secret" not in r.text
    health = http.get("/health")
    assert health.status_code == 503
    assert "engine loop stopped" in health.json()["error"]["message"]
    assert "secret" not in health.text


def test_abort_ends_the_stream_with_a_finished_output(app_engine):
    _, async_engine = app_engine

    async def main():
        params = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0)
        outputs = []
        async for out in async_engine.generate("def f(x):", params, request_id="to-abort"):
            outputs.append(out)
            if len(outputs) == 2:
                async_engine.abort("to-abort")
        return outputs

    outputs = asyncio.run(asyncio.wait_for(main(), timeout=30))
    assert outputs[-1].finished
    assert outputs[-1].outputs[0].finish_reason == "abort"
    assert len(outputs[-1].outputs[0].token_ids) < 400


def test_fields_the_server_does_not_implement_are_400_by_name(app_engine):
    http, _ = app_engine
    for field, value in [("no_such_field", 1), ("early_stopping", True),
                         ("length_penalty", 0.5)]:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                               field: value})
        assert r.status_code == 400, field
        assert r.json()["error"]["param"] == field
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                           "user": "u1", "metadata": {"k": "v"}, "store": False})
    assert r.status_code == 200


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                  max_size=3),
    max_leaves=6)
_FIELDS = ["temperature", "top_p", "top_k", "min_p", "seed", "n", "max_tokens", "stop",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs",
           "min_tokens", "stop_token_ids", "ignore_eos", "echo", "prompt_logprobs",
           "truncate_prompt_tokens", "stream", "prompt", "best_of", "stream_options",
           "skip_special_tokens", "include_stop_str_in_output", "user"]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(fields=st.dictionaries(st.sampled_from(_FIELDS), _JSON_VALUES, max_size=4))
def test_fuzzed_completion_bodies_never_get_a_5xx(app_engine, fields):
    http, async_engine = app_engine
    body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 3, **fields}
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
        body["max_tokens"] = 8  # keep each example short
    r = http.post("/v1/completions", json=body)
    assert r.status_code < 500, (body, r.text)
    assert async_engine.dead_reason is None


def test_metrics_expose_no_filesystem_path(llama_path):
    with running_server([llama_path, "--max-model-len", "128"]) as url:  # vllm serve's form
        with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
            assert [m["id"] for m in json.loads(r.read())["data"]] == [llama_path]
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
            text = r.read().decode()
    assert llama_path not in text
    assert 'model_name="' in text
