"""Review of data-parallel serving from the outside, as a user, the openai client and an API
fuzzer see it: bad requests, disconnects, a replica that dies, ``/metrics`` and shutdown of a
``hitchllm serve -dp 2`` server, checked against the one-engine server (an in-process app,
the reference) and against the sums the metrics must equal.

One server serves the module (started in a session of its own, so that a test can signal its
whole process group as systemd does); the tests that kill a replica and stop the server run
last, in that order. Every request and wait has a timeout, and the module ends by checking
that no replica process is left.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from server_process import free_port, in_process_server, scrape, spawned_children

from hitchllm.config import EngineConfig
from hitchllm.data_parallel.balancer import BalancerPolicy, LoadBalancer

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")

MODEL = "tiny"
ENGINE_ARGS = ["--block-size", "4", "--max-model-len", "256"]


class DPServer:
    """A ``hitchllm serve -dp 2`` process, its log file and its replicas' pids."""

    def __init__(self, proc: subprocess.Popen, url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log
        self.replica_pids = spawned_children(proc.pid)


@pytest.fixture(scope="module")
def dp(llama_path, tmp_path_factory) -> Iterator[DPServer]:
    port = free_port()
    log = tmp_path_factory.mktemp("dp-review") / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hitchllm.entrypoints.cli", "serve", llama_path,
             "--served-model-name", MODEL, "-dp", "2", "--port", str(port), *ENGINE_ARGS],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 180
        while health(url)[0] != 200:
            assert proc.poll() is None, f"server exited early:\n{log.read_text()}"
            assert time.monotonic() < deadline, "server did not become healthy in time"
            time.sleep(0.2)
        server = DPServer(proc, url, log)
        pids = server.replica_pids
        assert len(pids) == 2
        yield server
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in pids:  # a replica left behind fails the module and is not left running
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
                pytest.fail(f"replica pid {pid} outlived its server")


@pytest.fixture(scope="module")
def reference(llama_path):
    """The one-engine server (data_parallel_size 1), in this process."""
    with in_process_server(llama_path, MODEL) as http:
        yield http


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited and not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def health(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
    except OSError:
        return 0, ""


def post(url: str, path: str, body: dict | None) -> tuple[int, dict]:
    """POST ``body`` (GET when None); the status and the JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{url}{path}", data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def per_replica(url: str, name: str) -> list[float]:
    return [scrape(url, name, f'replica="{i}"') for i in range(2)]


def idle(url: str) -> None:
    """Nothing runs, waits or holds KV blocks on any replica, and the balancer counts no
    request in flight (the replicas' numbers arrive a step late: wait a little)."""
    deadline = time.monotonic() + 10
    while True:
        state = {name: scrape(url, f"hitchllm:{name}") for name in (
            "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
            "data_parallel_requests_in_flight")}
        if not any(state.values()):
            return
        assert time.monotonic() < deadline, f"requests left behind: {state}"
        time.sleep(0.1)


def stream_lines(url: str, body: dict, first: threading.Event | None = None) -> list[str]:
    """The lines of a streamed completion; ``first`` is set once the first chunk is in."""
    request = urllib.request.Request(f"{url}/v1/completions",
                                     json.dumps({**body, "stream": True}).encode(),
                                     {"Content-Type": "application/json"})
    lines = []
    with urllib.request.urlopen(request, timeout=60) as r:
        for raw in r:
            if line := raw.decode().strip():
                lines.append(line)
                if first is not None:
                    first.set()
    return lines


COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 5}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
# Requests a fuzzer sends; most are refused by the engine, inside the replica.
BAD_REQUESTS = [
    ("/v1/completions", {**COMPLETION, "top_p": 2}),
    ("/v1/completions", {**COMPLETION, "temperature": -1}),
    ("/v1/completions", {**COMPLETION, "max_tokens": -1}),
    ("/v1/completions", {**COMPLETION, "prompt": [1] * 300}),
    ("/v1/completions", {**COMPLETION, "prompt": "word " * 400}),
    ("/v1/completions", {**COMPLETION, "prompt": [999_999_999]}),
    ("/v1/completions", {**COMPLETION, "prompt": []}),
    ("/v1/completions", {**COMPLETION, "prompt": ["fine", [1] * 300], "n": 2}),
    ("/v1/completions", {**COMPLETION, "logprobs": 21}),
    ("/v1/completions", {**COMPLETION, "n": 3, "best_of": 2}),
    ("/v1/completions", {**COMPLETION, "prompt_logprobs": 1, "stream": True}),
    ("/v1/completions", {**COMPLETION, "stop_token_ids": [999_999_999]}),
    ("/v1/completions", {**COMPLETION, "allowed_token_ids": [999_999]}),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"999999999": 1}}),
    ("/v1/completions", {**COMPLETION, "guided_regex": "("}),
    ("/v1/completions", {**COMPLETION, "model": "no-such-model"}),
    ("/v1/completions", {**COMPLETION, "model": "no-such-lora", "stream": True}),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 30}),
    ("/v1/chat/completions", {**CHAT, "messages": []}),
    ("/v1/chat/completions", {**CHAT, "n": 2, "stream": True, "min_tokens": -1}),
]


def test_bad_requests_get_the_one_engine_errors_and_leave_no_request_behind(dp, reference):
    for path, body in BAD_REQUESTS:
        want = reference.post(path, json=body)
        status, got = post(dp.url, path, body)
        assert 400 <= status < 500, (body, got)
        assert (status, got) == (want.status_code, want.json()), body
    # max_tokens past max_model_len is capped, as with one engine.
    body = {**COMPLETION, "max_tokens": 100_000, "ignore_eos": True}
    want = reference.post("/v1/completions", json=body).json()
    status, got = post(dp.url, "/v1/completions", body)
    assert status == 200 and got["usage"] == want["usage"]
    # The routes the server answers itself: the same with one engine.
    for method, path, body in [
        ("GET", "/v1/models", None), ("GET", f"/v1/models/{MODEL}", None),
        ("GET", "/v1/models/nope", None), ("POST", "/tokenize", {"prompt": "hello"}),
        ("POST", "/tokenize", {"messages": CHAT["messages"], "model": MODEL}),
        ("POST", "/tokenize", {"prompt": "x", "model": "nope"}),
        ("POST", "/detokenize", {"tokens": [5, 6]}), ("POST", "/detokenize", {"tokens": [10**6]}),
    ]:
        want = reference.request(method, path, json=body)
        got = post(dp.url, path, body)
        assert got == (want.status_code, want.json()), path
    client = openai.OpenAI(base_url=f"{dp.url}/v1", api_key="none", max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model=MODEL, prompt=[1] * 300, max_tokens=1)
    idle(dp.url)
    assert health(dp.url)[0] == 200
    # Both replicas still answer (the round robin reaches each).
    for _ in range(2):
        answer = client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                           extra_body={"ignore_eos": True})
        assert answer.usage.completion_tokens == 2


def test_merged_metrics_equal_the_requests_served(dp):
    """Counters and histograms of ``/metrics`` are the sums over both replicas: checked
    against the number of requests and tokens sent, spread over both."""
    url = dp.url
    names = ("e2e_request_latency_seconds_count", "e2e_request_latency_seconds_sum",
             "time_to_first_token_seconds_count", "generation_tokens_total",
             "prompt_tokens_total")
    idle(url)  # and the counters settled: the requests of the tests before are counted
    before: dict[str, float] = {}
    deadline = time.monotonic() + 10
    while before != (now := {n: scrape(url, f"hitchllm:{n}") for n in names}):
        assert time.monotonic() < deadline
        before = now
        time.sleep(0.3)
    routed_before = per_replica(url, "hitchllm:data_parallel_requests_routed_total")

    async def main() -> None:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                    timeout=60)
        await asyncio.gather(*[client.completions.create(
            model=MODEL, prompt=[11, 12, 13 + i], max_tokens=4, n=2,
            extra_body={"ignore_eos": True}) for i in range(6)])

    asyncio.run(asyncio.wait_for(main(), 60))
    routed_after = per_replica(url, "hitchllm:data_parallel_requests_routed_total")
    routed = [a - b for a, b in zip(routed_after, routed_before)]
    assert sum(routed) == 6 and min(routed) >= 1
    delta = {n: scrape(url, f"hitchllm:{n}") - before[n] for n in names}
    assert delta["e2e_request_latency_seconds_count"] == 6
    assert delta["time_to_first_token_seconds_count"] == 6
    assert delta["e2e_request_latency_seconds_sum"] > 0
    assert delta["generation_tokens_total"] == 6 * 2 * 4
    assert delta["prompt_tokens_total"] == 6 * 3
    # A histogram's +Inf bucket is its count; requests finished by reason add up to it too.
    count = scrape(url, "hitchllm:e2e_request_latency_seconds_count")
    assert scrape(url, "hitchllm:e2e_request_latency_seconds_bucket", 'le="+Inf"') == count
    assert scrape(url, "hitchllm:request_success_total") == count


def test_concurrent_streams_with_disconnects_abort_on_their_replicas(dp):
    url = dp.url
    aborted_before = scrape_or_zero(url, "hitchllm:request_success_total",
                                    'finished_reason="abort"')

    async def one(i: int) -> str:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                    timeout=60)
        # The tiny model is fast: those that leave ask for many sequences (a few seconds'
        # work) so that they still run when the server sees their client gone.
        stream = await client.completions.create(
            model=MODEL, prompt=f"def f{i}(x):", max_tokens=240 if i % 2 else 8,
            stream=True, n=48 if i % 2 else 1 + i % 3, extra_body={"ignore_eos": True})
        async for _ in stream:
            if i % 2:  # leave after the first chunk
                break
        await stream.close()
        return "left" if i % 2 else "done"

    async def main() -> list[str]:
        return await asyncio.gather(*[one(i) for i in range(8)])

    assert sorted(asyncio.run(asyncio.wait_for(main(), 60))) == ["done"] * 4 + ["left"] * 4
    idle(url)
    # The four requests that lost their client were aborted where they ran.
    assert scrape(url, "hitchllm:request_success_total",
                  'finished_reason="abort"') - aborted_before == 4


def scrape_or_zero(url: str, name: str, label: str = "") -> float:
    try:
        return scrape(url, name, label)
    except KeyError:
        return 0.0


def test_a_replica_that_stops_reading_stalls_no_one_else(dp):
    """A hung replica (here: stopped) must not freeze the server: a large request routed to
    it must not block the event loop while its pipe is full; the other replica serves on."""
    url = dp.url
    answers: list[tuple[int, dict]] = []

    def send(first: int) -> None:  # prompts of no common prefix: load alone routes them
        prompt = [1 + (first + i) % 500 for i in range(500_000)]
        answers.append(post(url, "/v1/completions",
                            {"model": MODEL, "prompt": prompt, "max_tokens": 1}))

    threads = [threading.Thread(target=send, args=(k,)) for k in range(2)]
    routed = sum(per_replica(url, "hitchllm:data_parallel_requests_routed_total"))
    os.kill(dp.replica_pids[0], signal.SIGSTOP)
    try:
        # Whether the first goes to the stopped replica or to the other (and is answered
        # there), one of the two ends up on the stopped one, the other is answered.
        threads[0].start()
        time.sleep(1)
        threads[1].start()
        deadline = time.monotonic() + 30
        while not answers:
            assert time.monotonic() < deadline, "the server stalled"
            time.sleep(0.05)
        # /metrics answers within a scrape timeout (here 8 s; Prometheus' default is 10 s),
        # with the stopped replica's last numbers, until both large requests are routed (the
        # first may be answered before the second is parsed).
        while True:
            with urllib.request.urlopen(f"{url}/metrics", timeout=8) as r:
                text = r.read().decode()
            counts = re.findall(
                r"^hitchllm:data_parallel_requests_routed_total\{.*\} (\S+)$", text, re.M)
            if sum(float(c) for c in counts) == routed + 2:
                break
            assert time.monotonic() < deadline, f"not both routed: {counts}"
            time.sleep(0.2)
        # The stopped replica has a request in flight: a new one goes to the other.
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                               timeout=15)
        answer = client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                           extra_body={"ignore_eos": True})
        assert answer.usage.completion_tokens == 2
        assert health(url)[0] == 200
    finally:
        os.kill(dp.replica_pids[0], signal.SIGCONT)
    for t in threads:
        t.join(30)
    assert len(answers) == 2
    for status, error in answers:
        assert status == 400 and "max_model_len" in error["error"]["message"]
    idle(url)


def test_a_dead_replicas_gauges_leave_the_metrics_its_counters_stay(dp):
    """Runs after the tests above: it kills one of two replicas while each serves a stream;
    once the other's stream is done, nothing may show as running."""
    url = dp.url
    n = 96  # sequences per request: seconds of work on the tiny model
    streams: list[list[str]] = [[], []]
    firsts = [threading.Event(), threading.Event()]

    def run(i: int) -> None:
        body = {"model": MODEL, "prompt": f"def g{i}(x):", "max_tokens": 240, "n": n,
                "ignore_eos": True}
        streams[i].extend(stream_lines(url, body, firsts[i]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    assert all(f.wait(30) for f in firsts)
    deadline = time.monotonic() + 10
    # Both replicas have reported their request's sequences running.
    while scrape(url, "hitchllm:num_requests_running") != 2 * n:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert per_replica(url, "hitchllm:data_parallel_requests_in_flight") == [1, 1]
    prompt_tokens = scrape(url, "hitchllm:prompt_tokens_total")
    os.kill(dp.replica_pids[0], signal.SIGKILL)
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a stream hung"
    ends = sorted(lines[-1] for lines in streams)
    assert ends[0] == "data: [DONE]" and "stopped: its process" in ends[1]
    assert sorted(per_replica(url, "hitchllm:data_parallel_replica_up")) == [0, 1]
    # Nothing runs any more: the dead replica's last gauges are not served as current.
    idle(url)
    # Its counters are: totals never drop.
    assert scrape(url, "hitchllm:prompt_tokens_total") == prompt_tokens


def test_sigterm_to_the_process_group_drains_streams_and_leaves_no_process(dp):
    """Runs last: systemd (KillMode=control-group) and ``kill -TERM -PGID`` signal every
    process of the server. As with one engine, a running stream is finished within the
    graceful shutdown; no replica is reported dead; every process exits."""
    first = threading.Event()
    lines: list[str] = []
    # Many sequences: running when the signal comes, done well within the 5 s grace.
    body = {"model": MODEL, "prompt": "def h(x):", "max_tokens": 150, "n": 32,
            "ignore_eos": True}
    thread = threading.Thread(target=lambda: lines.extend(stream_lines(dp.url, body, first)))
    thread.start()
    assert first.wait(30)
    logged = len(dp.log.read_text())
    os.killpg(dp.proc.pid, signal.SIGTERM)
    thread.join(30)
    assert not thread.is_alive()
    assert dp.proc.wait(30) == 128 + signal.SIGTERM
    assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)
    assert "stopped:" not in dp.log.read_text()[logged:]
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in dp.replica_pids):
        assert time.monotonic() < deadline, "a replica outlived its server"
        time.sleep(0.1)


def test_prefix_affinity_is_off_without_a_prefix_cache():
    """A shared prefix only pays where replicas cache prefixes; without it, load alone
    decides (no replica is piled up for nothing)."""
    shared = list(range(100, 164))  # 16 blocks of 4 tokens
    cached = LoadBalancer(2, BalancerPolicy.for_config(EngineConfig(block_size=4)))
    assert [cached.choose([*shared, i]) for i in range(4)] == [0, 0, 0, 0]
    uncached = LoadBalancer(2, BalancerPolicy.for_config(
        EngineConfig(block_size=4, enable_prefix_caching=False)))
    assert [uncached.choose([*shared, i]) for i in range(4)] == [0, 1, 0, 1]


def test_sigterm_while_the_replicas_load_stops_them(monkeypatch, llama_path):
    """The server exits through Python on SIGTERM (shutting its replicas down) from before
    it starts them: a SIGTERM while they load a large model must not leave them loading."""
    from hitchllm.entrypoints.openai import api_server

    seen = []

    def start_engines(*args, **kwargs):
        seen.append(signal.getsignal(signal.SIGTERM))
        raise ValueError("stop here")

    monkeypatch.setattr(api_server, "_start_engines", start_engines)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(ValueError, match="stop here"):
            api_server.serve(EngineConfig(model=llama_path), data_parallel_size=2)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert seen == [api_server._exit_on_signal]


def test_a_bad_argument_is_one_error_line_not_a_traceback_per_replica(tmp_path, caplog):
    """What a user gets wrong (a bad checkpoint, max_model_len too large) is reported once by
    the server, as with one engine; each replica logs no traceback of it. A replica's own
    failure (not a ValueError) still logs its traceback, the server only gets its name."""
    import multiprocessing

    from hitchllm.data_parallel.messages import StartFailed
    from hitchllm.data_parallel.replica import ReplicaSpec, run_replica

    (tmp_path / "config.json").write_text("{}")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    ours, theirs = multiprocessing.Pipe()
    try:
        run_replica(ReplicaSpec(0, EngineConfig(model=str(tmp_path)), MODEL), theirs)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    message = ours.recv()
    assert isinstance(message, StartFailed) and message.error.kind == "invalid"
    assert "architectures" in message.error.message
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
