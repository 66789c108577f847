"""The OpenAI-compatible server, driven by the official ``openai`` client over loopback."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import urllib.error
import urllib.request

import openai
import pytest
from server_process import running_server, scrape
from transformers import AutoTokenizer

from hitchllm import LLM, SamplingParams

KEY = "test-key-123"
MODEL = "tiny"


@pytest.fixture(scope="module")
def server(llama_path):
    args = ["--model", llama_path, "--served-model-name", MODEL, "--api-key", KEY,
            "--block-size", "4", "--max-model-len", "256"]
    with running_server(args) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline(llama_path):
    return LLM(llama_path, block_size=4, max_model_len=256)


def greedy_extra():
    return {"ignore_eos": True}


def test_completion_matches_offline_generate_and_stream(client, offline):
    prompt = "def add(a, b):"
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body=greedy_extra())
    expected = offline.generate([prompt], SamplingParams(max_tokens=12, temperature=0,
                                                         ignore_eos=True), use_tqdm=False)[0]
    choice = resp.choices[0]
    assert choice.text == expected.outputs[0].text
    assert choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert resp.usage.completion_tokens == 12
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 12

    chunks = list(client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=greedy_extra()))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_batch_prompts_and_n(client):
    for prompt in (["a b", "c d e"], [[5, 6, 7], [8, 9]]):
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, n=2,
                                         temperature=0.8, seed=3,
                                         extra_body={"ignore_eos": True})
        assert sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
        assert resp.usage.completion_tokens == 16


def test_chat_matches_offline_chat_and_stream(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          max_completion_tokens=10, extra_body=greedy_extra())
    expected = offline.chat(messages, SamplingParams(max_tokens=10, temperature=0,
                                                     ignore_eos=True), use_tqdm=False)[0]
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected.outputs[0].text
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert resp.usage.completion_tokens == 10
    stream = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                            max_tokens=10, stream=True,
                                            extra_body=greedy_extra())
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == resp.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_logprobs_in_both_endpoints(client):
    resp = client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0,
                                     logprobs=2)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == 3 and len(lp.token_logprobs) == 3
    assert all(v <= 0 for v in lp.token_logprobs) and len(lp.top_logprobs[0]) >= 2
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=3, temperature=0, logprobs=True,
                                          top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and len(content[0].top_logprobs) == 2
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob)


def test_extra_sampling_fields_are_honoured(client):
    base = client.completions.create(model=MODEL, prompt="stop", max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    ids_text = base.choices[0].text
    stop = ids_text[2:4]
    resp = client.completions.create(model=MODEL, prompt="stop", max_tokens=8, temperature=0,
                                     stop=[stop], extra_body={"ignore_eos": True})
    assert resp.choices[0].text == ids_text[: ids_text.find(stop)]
    assert resp.choices[0].finish_reason == "stop"
    resp = client.completions.create(model=MODEL, prompt="q", max_tokens=6, temperature=1.0,
                                     extra_body={"top_k": 1, "min_p": 0.1,
                                                 "repetition_penalty": 1.0, "min_tokens": 6})
    greedy = client.completions.create(model=MODEL, prompt="q", max_tokens=6, temperature=0,
                                       extra_body={"min_tokens": 6})
    assert resp.choices[0].text == greedy.choices[0].text  # top_k=1 is greedy


@pytest.mark.parametrize("kwargs, match", [
    ({"top_p": 7.0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"prompt": "x " * 400}, "max_model_len"),
    ({"logit_bias": {"5": 300.0}}, "logit_bias"),
    ({"extra_body": {"stop_token_ids": [10**7]}}, "vocabulary"),
])
def test_invalid_requests_get_400(client, kwargs, match):
    args = {"model": MODEL, "prompt": "x", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError, match=match) as err:
        client.completions.create(**args)
    assert err.value.status_code == 400


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError, match="nope"):
        client.completions.create(model="nope", prompt="x", max_tokens=2)


def test_malformed_json_is_400(server):
    req = urllib.request.Request(f"{server}/v1/completions", data=b"{not json",
                                 headers={"Authorization": f"Bearer {KEY}",
                                          "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 400
    assert "error" in json.loads(err.value.read())


def test_api_key_is_enforced(server):
    bad = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x", max_tokens=2)
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}).encode()
    req = urllib.request.Request(f"{server}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 401
    with urllib.request.urlopen(f"{server}/health", timeout=5) as r:
        assert r.status == 200  # health and metrics stay open for probes


def test_models_and_version(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    with urllib.request.urlopen(f"{server}/version", timeout=5) as r:
        assert "version" in json.loads(r.read())


def test_64_concurrent_streams_finish_and_leak_nothing(server):
    aclient = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)

    async def one(i: int) -> int:
        stream = await aclient.completions.create(
            model=MODEL, prompt=f"request {i} " * (1 + i % 7), max_tokens=8 + i % 5,
            temperature=0.7, seed=i, stream=True, extra_body={"ignore_eos": True})
        n = 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason is not None:
                n += 1
        return n

    async def bad(i: int) -> str:
        try:
            await aclient.completions.create(model=MODEL, prompt="x " * 300, max_tokens=4)
        except openai.BadRequestError:
            return "rejected"
        return "accepted"

    async def main():
        # Bad requests arrive in the middle of the streams and must not disturb them.
        return await asyncio.gather(*(one(i) for i in range(64)), *(bad(i) for i in range(8)))

    assert asyncio.run(main()) == [1] * 64 + ["rejected"] * 8
    assert scrape(server, "hitchllm:num_requests_running") == 0
    assert scrape(server, "hitchllm:num_requests_waiting") == 0
    assert scrape(server, "hitchllm:kv_cache_usage_perc") == 0
    assert scrape(server, "hitchllm:generation_tokens_total") > 0
    assert scrape(server, "hitchllm:time_to_first_token_seconds_count") >= 64


def test_dropped_stream_is_aborted(server, client):
    before = _aborted(server)
    stream = client.completions.create(model=MODEL, prompt="go", max_tokens=240, stream=True,
                                       temperature=0, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    deadline = time.monotonic() + 10
    while _aborted(server) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _aborted(server) == before + 1
    assert scrape(server, "hitchllm:num_requests_running") == 0
    assert scrape(server, "hitchllm:kv_cache_usage_perc") == 0


def _aborted(server: str) -> float:
    try:
        return scrape(server, "hitchllm:request_success_total", 'finished_reason="abort"')
    except KeyError:
        return 0.0


def test_model_without_chat_template_gets_a_clear_400(tmp_path, llama_path):
    model = tmp_path / "no-template"
    shutil.copytree(llama_path, model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    with running_server(["--model", str(model), "--served-model-name", MODEL]) as url:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="--chat-template"):
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
        assert c.completions.create(model=MODEL, prompt="x", max_tokens=2).choices
    with running_server(["--model", str(model), "--served-model-name", MODEL,
                         "--chat-template", str(template)]) as url:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        resp = c.chat.completions.create(model=MODEL, max_tokens=2,
                                         messages=[{"role": "user", "content": "x y"}])
    rendered = AutoTokenizer.from_pretrained(llama_path)("x y\n", add_special_tokens=False)
    assert resp.usage.prompt_tokens == len(rendered.input_ids)


def test_bench_serve_reports_every_request(server, tmp_path, capsys):
    import argparse

    from hitchllm.entrypoints import bench_serve

    parser = argparse.ArgumentParser()
    bench_serve.add_args(parser)
    results = tmp_path / "RESULTS.md"
    args = parser.parse_args(["--base-url", f"{server}/v1", "--model", MODEL, "--api-key", KEY,
                              "--num-prompts", "6", "--max-concurrency", "3",
                              "--input-len", "4", "12", "--output-len", "3", "6",
                              "--append-results", str(results)])
    assert bench_serve.main(args) == 0
    out = capsys.readouterr().out
    assert "requests 6 (failed 0)" in out and "ttft" in out
    expected_tokens = sum(n for _, n in bench_serve.make_workload(args))
    assert f"({expected_tokens} tokens)" in out
    assert "| req/s |" in results.read_text()


def test_unknown_route_and_parameter_errors_use_openai_shape(server, client):
    req = urllib.request.Request(f"{server}/v1/nothing",
                                 headers={"Authorization": f"Bearer {KEY}"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 404
    assert json.loads(err.value.read())["error"]["code"] == 404
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", temperature=-1.0)
    assert bad.value.body["param"] == "temperature"
