"""One request's text on a terminal as the engine produces it (``generate`` and ``chat``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TextIO

from hitchllm.engine.llm_engine import LLMEngine, Prompt
from hitchllm.entrypoints.openai.streaming import stream_safe_length
from hitchllm.outputs import RequestOutput
from hitchllm.sampling_params import SamplingParams


def stream_request(
    engine: LLMEngine, prompt: Prompt, params: SamplingParams
) -> Iterator[RequestOutput]:
    """Queue ``prompt`` and yield its output after every step that advanced it; the last one
    is finished. If the caller stops early (Ctrl-C, a closed pipe), the request is aborted so
    that its KV blocks go back to the pool."""
    request_id = engine.new_request_id(params.n)
    finished = False
    try:  # from before the request is queued: an interrupt right after still aborts it
        engine.add_request(prompt, params, request_id=request_id)
        while not finished:
            for out in engine.step():
                if out.request_id == request_id:
                    finished = out.finished
                    yield out
    finally:
        if not finished:
            engine.abort_request(request_id)


def print_stream(
    outputs: Iterator[RequestOutput], params: SamplingParams, out: TextIO
) -> RequestOutput:
    """Write the first sequence's new text to ``out`` as it arrives (flushed each time) and
    return the final output. Text that may still become a stop string, and so be cut, waits
    until it cannot: what is written is always a prefix of the final text."""
    written = 0
    final = None
    for final in outputs:
        seq = final.outputs[0]
        end = stream_safe_length(seq.text, params.stop_strings, seq.finished)
        if end > written:
            out.write(seq.text[written:end])
            out.flush()
            written = end
    if final is None:
        raise RuntimeError("the engine returned no output for the request")
    return final
