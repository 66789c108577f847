"""``hitchllm serve --data-parallel-size 2``: two engine replicas behind one server, checked
against the same server with one engine (an in-process app, the reference) and through its
``/metrics``.

One server serves the module (starting two replicas takes a while on CI's two cores); the
test that kills a replica runs last. Every request and wait has a timeout, so a hang fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from server_process import in_process_server, running_server_process, scrape, spawned_children

from hitchllm.entrypoints import cli

MODEL = "tiny"
ENGINE_ARGS = ["--block-size", "4", "--max-model-len", "256"]
PROMPTS = ["def add(a, b):", "The quick brown fox", "import numpy as np\n", "x = [1, 2,"]
CHATS = [[{"role": "user", "content": "Hi!"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]]
ROUTED = "hitchllm:data_parallel_requests_routed_total"


@pytest.fixture(scope="module")
def dp_server(llama_path):
    with running_server_process([llama_path, "--served-model-name", MODEL, "-dp", "2",
                                 *ENGINE_ARGS], timeout=240) as (url, proc):
        yield url, proc


@pytest.fixture(scope="module")
def server(dp_server):
    return dp_server[0]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(llama_path):
    """The one-engine server (data_parallel_size 1), in this process."""
    with in_process_server(llama_path, MODEL) as http:
        yield http


def routed(url: str) -> list[float]:
    return [scrape(url, ROUTED, f'replica="{i}"') for i in range(2)]


def aborted(url: str) -> float:
    try:
        return scrape(url, "hitchllm:request_success_total", 'finished_reason="abort"')
    except KeyError:  # no request has been aborted yet
        return 0.0


def sse_texts(body: str, field: str) -> str:
    """The concatenated text of a streamed response (``field``: ``text`` or ``content``)."""
    out = []
    for line in body.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:])["choices"]:
                out.append(choice.get("text") or choice.get("delta", {}).get(field) or "")
    return "".join(out)


def test_greedy_answers_equal_one_engine_streaming_or_not_and_use_both_replicas(
    server, client, reference
):
    before = routed(server)
    body = {"model": MODEL, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    for prompt in PROMPTS:
        want = reference.post("/v1/completions", json={**body, "prompt": prompt}).json()
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert got.choices[0].text == want["choices"][0]["text"]
        assert got.usage.completion_tokens == 10
        chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in chunks if c.choices) == got.choices[0].text
    for messages in CHATS:
        want = reference.post("/v1/chat/completions",
                              json={**body, "messages": messages}).json()
        got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                             temperature=0, extra_body={"ignore_eos": True})
        assert got.choices[0].message.content == want["choices"][0]["message"]["content"]
        stream = reference.post("/v1/chat/completions",
                                json={**body, "messages": messages, "stream": True}).text
        chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                                temperature=0, stream=True,
                                                extra_body={"ignore_eos": True})
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == got.choices[0].message.content == sse_texts(stream, "content")
    after = routed(server)
    # 12 requests one after the other, each with its own prompt: both replicas served.
    assert sum(after) - sum(before) == 2 * len(PROMPTS) + 2 * len(CHATS)
    assert min(a - b for a, b in zip(after, before)) >= 4


def test_concurrent_requests_spread_evenly_and_metrics_sum_the_replicas(server):
    async def main() -> list[int]:
        aclient = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0,
                                     timeout=60)
        answers = await asyncio.gather(*[aclient.completions.create(
            model=MODEL, prompt=[7, 8, 9, i], max_tokens=6, temperature=0,
            extra_body={"ignore_eos": True}) for i in range(8)])
        return [a.usage.completion_tokens for a in answers]

    routed_before = routed(server)
    tokens_before = scrape(server, "hitchllm:generation_tokens_total")
    prompt_before = scrape(server, "hitchllm:prompt_tokens_total")
    assert asyncio.run(asyncio.wait_for(main(), 60)) == [6] * 8
    spread = [a - b for a, b in zip(routed(server), routed_before)]
    # Least loaded first: 4 each while all 8 are in flight (one may finish before the last
    # arrive on a busy machine).
    assert sum(spread) == 8 and min(spread) >= 3
    # The merged counters hold both replicas' tokens: half of them came from each.
    assert scrape(server, "hitchllm:generation_tokens_total") - tokens_before == 8 * 6
    assert scrape(server, "hitchllm:prompt_tokens_total") - prompt_before == 8 * 4
    assert scrape(server, "hitchllm:num_requests_running") == 0
    assert scrape(server, "hitchllm:e2e_request_latency_seconds_count") >= 8


def test_a_repeated_prefix_stays_on_one_replica_and_hits_its_prefix_cache(server, client):
    shared = list(range(100, 140))  # 10 blocks of 4 tokens
    before, hits_before = routed(server), scrape(server, "hitchllm:prefix_cache_hits_total")
    for i in range(4):
        client.completions.create(model=MODEL, prompt=[*shared, 200 + i], max_tokens=2,
                                  temperature=0)
    spread = sorted(a - b for a, b in zip(routed(server), before))
    assert spread == [0, 4]
    # Requests 2 to 4 found the 40 shared tokens (10 full blocks) cached.
    assert scrape(server, "hitchllm:prefix_cache_hits_total") - hits_before >= 3 * 40


def test_a_client_that_disconnects_aborts_its_request_on_its_replica(server):
    aborted_before = aborted(server)
    body = json.dumps({"model": MODEL, "prompt": "def f(x):", "max_tokens": 240,
                       "ignore_eos": True, "stream": True}).encode()
    request = urllib.request.Request(f"{server}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        r.readline()  # the first chunk: the request runs
    deadline = time.monotonic() + 20
    while aborted(server) == aborted_before:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.1)
    assert scrape(server, "hitchllm:num_requests_running") == 0
    in_flight = scrape(server, "hitchllm:data_parallel_requests_in_flight")
    assert in_flight == 0


def test_bench_serve_runs_against_the_data_parallel_server(server, capsys):
    before = routed(server)
    rc = cli.main(["bench", "serve", "--base-url", f"{server}/v1", "--model", MODEL,
                   "--num-prompts", "6", "--input-len", "4", "8", "--output-len", "3", "5"])
    assert rc == 0, capsys.readouterr().out
    assert "requests 6 (failed 0)" in capsys.readouterr().out
    spread = [a - b for a, b in zip(routed(server), before)]
    assert sum(spread) == 6 and min(spread) >= 2


def health(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_killed_replica_fails_its_requests_and_the_other_serves_on(dp_server):
    """Runs last in this module: it leaves the server with one replica."""
    url, proc = dp_server
    pids = spawned_children(proc.pid)
    assert len(pids) == 2
    streams: dict[int, str] = {}
    started = threading.Barrier(3, timeout=30)

    def stream(i: int) -> None:
        body = json.dumps({"model": MODEL, "prompt": f"def f{i}(x):", "max_tokens": 240,
                           "ignore_eos": True, "stream": True}).encode()
        request = urllib.request.Request(f"{url}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as r:
            first = r.readline().decode()
            started.wait()
            streams[i] = first + r.read().decode()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    started.wait()  # one request on each replica (the balancer spreads them), both running
    os.kill(pids[0], signal.SIGKILL)
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a stream hung"
    failed = [s for s in streams.values() if '"error"' in s]
    assert len(failed) == 1 and "data-parallel replica" in failed[0]
    assert "exited with code -9" in failed[0]
    ok = [s for s in streams.values() if '"error"' not in s]
    assert len(ok) == 1 and ok[0].rstrip().endswith("data: [DONE]")
    status, body = health(url)
    assert status == 503 and "data-parallel replica" in body
    assert sorted(scrape(url, "hitchllm:data_parallel_replica_up", f'replica="{i}"')
                  for i in range(2)) == [0, 1]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=30)
    for _ in range(2):  # the survivor takes every new request
        answer = client.completions.create(model=MODEL, prompt="x", max_tokens=3,
                                           extra_body={"ignore_eos": True})
        assert answer.usage.completion_tokens == 3
    # Shutting down reaps the survivor too.
    proc.terminate()
    assert proc.wait(30) == 128 + signal.SIGTERM
    time.sleep(0.5)
    assert not [p for p in pids if Path(f"/proc/{p}").exists()
                and b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
