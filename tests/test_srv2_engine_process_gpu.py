"""GPU: ``hitchllm serve`` with its engine in a process of its own (the default) on a pinned
CUDA device streams, for concurrent greedy requests, exactly the offline engine's tokens (float32,
so batching cannot flip near-ties)."""

from __future__ import annotations

import asyncio
import json

import pytest
from server_process import running_server

from hitchllm import LLM, SamplingParams
from hitchllm.entrypoints.sse_client import split_url, stream_events

pytestmark = pytest.mark.gpu

MODEL = "tiny"
ENGINE = dict(device="cuda:0", dtype="float32", block_size=16, max_model_len=256)


async def _stream(url: str, prompt: list[int], max_tokens: int) -> list[int]:
    host, port, path = split_url(f"{url}/v1")
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "logprobs": 0}
    tokens: list[str] = []
    async for _, data in stream_events(host, port, f"{path}/completions",
                                       json.dumps(body).encode()):
        if data == b"[DONE]":
            break
        tokens += json.loads(data)["choices"][0]["logprobs"]["tokens"]
    return tokens


@pytest.mark.parametrize("mode", ["--engine-process", "--no-engine-process"])
def test_streams_on_a_pinned_gpu_equal_the_offline_engine(llama_path, mode):
    prompts = [[3 + (7 * i + j) % 400 for j in range(5 + i)] for i in range(24)]
    llm = LLM(llama_path, **ENGINE)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=32, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    expected = [[tokenizer.decode([t]) for t in o.outputs[0].token_ids] for o in outs]
    del llm
    args = ["--model", llama_path, "--served-model-name", MODEL, "--device", "cuda:0",
            "--dtype", "float32", "--max-model-len", "256", mode]

    async def all_streams(url: str) -> list[list[str]]:
        return await asyncio.wait_for(
            asyncio.gather(*(_stream(url, p, 32) for p in prompts)), timeout=120)

    with running_server(args, timeout=300) as url:
        assert asyncio.run(all_streams(url)) == expected
