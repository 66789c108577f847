"""Many concurrent streams through the server deliver exactly the offline engine's greedy
tokens: outputs batched per engine step and coalesced for slow readers must drop, repeat or
reorder nothing."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from server_process import running_server

from hitchllm import LLM, SamplingParams
from hitchllm.entrypoints.sse_client import split_url, stream_events

MODEL = "tiny"
NUM_REQUESTS = 48


@pytest.fixture(scope="module", params=["--engine-process", "--no-engine-process"])
def server(llama_path, request):
    """The server with its engine in a process of its own (the default), and in a thread of
    the server's process."""
    args = ["--model", llama_path, "--served-model-name", MODEL, "--block-size", "4",
            "--max-model-len", "256", request.param]
    with running_server(args) as url:
        yield url


@pytest.fixture(scope="module")
def workload(llama_path):
    """(prompt token ids, max_tokens, n, logprobs) per request, and the offline engine's
    greedy token ids for each."""
    rng = random.Random(7)
    work = []
    for i in range(NUM_REQUESTS):
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(4, 40))]
        work.append((prompt, rng.randint(8, 40), 2 if i % 8 == 0 else 1,
                     1 if i % 3 == 0 else None))
    llm = LLM(llama_path, block_size=4, max_model_len=256)
    outs = llm.generate([{"prompt_token_ids": p} for p, *_ in work],
                        [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)
                         for _, m, *_ in work], use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    expected = [out.outputs[0].token_ids for out in outs]
    texts = [out.outputs[0].text for out in outs]
    return work, expected, texts, tokenizer


async def _stream(url: str, prompt: list[int], max_tokens: int, n: int,
                  logprobs: int | None, pause: float) -> list[dict]:
    host, port, path = split_url(f"{url}/v1")
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "n": n, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}
    if logprobs is not None:
        body["logprobs"] = logprobs
    chunks = []
    async for _, data in stream_events(host, port, f"{path}/completions",
                                       json.dumps(body).encode()):
        if data == b"[DONE]":
            break
        chunks.append(json.loads(data))
        if pause:  # a slow reader: the server coalesces the tokens it has not sent yet
            await asyncio.sleep(pause)
    return chunks


async def _all(url: str, work: list, pauses: list[float]) -> list[list[dict]]:
    return await asyncio.wait_for(
        asyncio.gather(*(_stream(url, p, m, n, lp, pause)
                         for (p, m, n, lp), pause in zip(work, pauses))), timeout=120)


def test_concurrent_streams_deliver_the_offline_greedy_tokens(server, workload):
    work, expected, texts, tokenizer = workload
    # Every fourth reader is slow, so its tokens pile up and arrive several per chunk.
    pauses = [0.05 if i % 4 == 1 else 0.0 for i in range(len(work))]
    results = asyncio.run(_all(server, work, pauses))
    coalesced = 0
    for (prompt, max_tokens, n, logprobs), want, text, chunks in zip(
            work, expected, texts, results):
        *body, usage_chunk = chunks
        assert usage_chunk["choices"] == []
        assert usage_chunk["usage"]["completion_tokens"] == n * max_tokens
        assert usage_chunk["usage"]["prompt_tokens"] == len(prompt)
        for index in range(n):
            mine = [c["choices"][0] for c in body if c["choices"][0]["index"] == index]
            assert "".join(c["text"] for c in mine) == text
            finishes = [c["finish_reason"] for c in mine]
            assert finishes[-1] == "length" and finishes.count("length") == 1
            if logprobs is not None:
                tokens = [t for c in mine for t in c["logprobs"]["tokens"]]
                assert tokens == [tokenizer.decode([t]) for t in want]
            coalesced += len(mine) < max_tokens
    assert coalesced, "no slow reader got several tokens in one chunk"


def test_sse_client_reports_an_error_status(server):
    from hitchllm.entrypoints.sse_client import HTTPStatusError

    async def ask() -> None:
        host, port, path = split_url(f"{server}/v1")
        body = json.dumps({"model": "no-such-model", "prompt": "x", "stream": True}).encode()
        async for _ in stream_events(host, port, f"{path}/completions", body):
            pass

    with pytest.raises(HTTPStatusError, match="HTTP 404"):
        asyncio.run(ask())
