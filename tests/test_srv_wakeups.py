"""``AsyncLLMEngine`` hands each engine step's outputs to the event loop in one wake-up, and a
request's stream keeps only the newest output its reader has not taken."""

from __future__ import annotations

import asyncio

import pytest

from hitchllm import SamplingParams
from hitchllm.config import EngineConfig
from hitchllm.engine.async_engine import AsyncLLMEngine, RequestStream, _push_all
from hitchllm.engine.llm_engine import LLMEngine
from hitchllm.outputs import CompletionOutput, RequestOutput

NUM_REQUESTS = 12
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def engine(llama_path):
    return LLMEngine(EngineConfig(model=llama_path, block_size=4, max_model_len=128))


def test_one_loop_wakeup_per_engine_step(engine):
    steps_with_outputs = 0

    def on_step(_engine, outputs, _now):
        nonlocal steps_with_outputs
        steps_with_outputs += bool(outputs)

    async def run() -> tuple[int, int, list[RequestOutput]]:
        loop = asyncio.get_running_loop()
        calls: dict[str, int] = {"deliveries": 0, "other": 0}
        plain = loop.call_soon_threadsafe

        def counting(callback, *args, **kwargs):
            calls["deliveries" if callback is _push_all else "other"] += 1
            return plain(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counting  # the engine thread wakes the loop through this
        async_engine = AsyncLLMEngine(engine, on_step=on_step)
        try:
            received = 0

            async def one(i: int) -> RequestOutput:
                nonlocal received
                params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
                outputs = [out async for out in async_engine.generate(
                    {"prompt_token_ids": [5 + i, 9, 17, 33]}, params, f"r{i}")]
                received += len(outputs)
                return outputs[-1]

            finals = await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))
        finally:
            async_engine.shutdown()
        return calls["deliveries"], received, finals

    deliveries, received, finals = asyncio.run(run())
    assert all(len(f.outputs[0].token_ids) == MAX_TOKENS and f.finished for f in finals)
    # One wake-up per step that produced outputs, however many requests it advanced; a
    # wake-up per request would be about NUM_REQUESTS times as many.
    assert deliveries == steps_with_outputs
    assert received > 2 * deliveries


def _output(num_tokens: int, finished: bool = False) -> RequestOutput:
    seq = CompletionOutput(0, "x" * num_tokens, list(range(num_tokens)),
                           finish_reason="length" if finished else None)
    return RequestOutput("r", None, [1], [seq], finished=finished)


def test_stream_keeps_only_the_newest_output_not_taken():
    async def run() -> list:
        stream = RequestStream(asyncio.get_running_loop())
        for n in (1, 2, 3):
            stream.push(_output(n))
        first = await stream.get()
        stream.push(_output(4))
        stream.push(_output(5, finished=True))
        stream.push(ValueError("after the end"))
        return [first, await stream.get(), await stream.get()]

    first, last, error = asyncio.run(run())
    assert first.outputs[0].token_ids == [0, 1, 2]
    assert last.finished and last.outputs[0].token_ids == [0, 1, 2, 3, 4]
    assert isinstance(error, ValueError)  # an exception is never coalesced away


def test_stream_wakes_a_waiting_reader_from_another_thread():
    async def run() -> RequestOutput:
        stream = RequestStream(asyncio.get_running_loop())
        reader = asyncio.create_task(stream.get())
        await asyncio.sleep(0)
        await asyncio.to_thread(stream.put, _output(2))
        return await asyncio.wait_for(reader, timeout=10)

    assert asyncio.run(run()).outputs[0].token_ids == [0, 1]
