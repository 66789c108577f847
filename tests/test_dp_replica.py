"""A replica's side of the pipe, run in this process (a thread instead of a process): outputs
come as deltas that rebuild the engine's outputs, an abort ends the request with a terminal
delivery, metrics calls are answered, and an engine loop that dies is reported (its request
fails with "dead", then ``Dead``) before the replica stops."""

from __future__ import annotations

import multiprocessing
import threading
from typing import Any

import pytest

from hitchllm.config import EngineConfig
from hitchllm.data_parallel.deltas import OutputDecoder, OutputDelta
from hitchllm.data_parallel.messages import (
    Abort,
    Call,
    Dead,
    Deliveries,
    Generate,
    Reply,
    WireError,
)
from hitchllm.data_parallel.pipe_engine import ReplicaServer
from hitchllm.engine.llm_engine import LLMEngine
from hitchllm.entrypoints.openai.metrics import ServerMetrics
from hitchllm.sampling_params import SamplingParams


def receive(conn: Any) -> Any:
    assert conn.poll(30), "the replica did not answer"
    return conn.recv()


def deliveries_until_end(conn: Any, request_id: str, decoder: OutputDecoder) -> list[Any]:
    """``request_id``'s deliveries, decoded, up to its terminal one."""
    got: list[Any] = []
    while True:
        message = receive(conn)
        assert isinstance(message, Deliveries)
        for rid, item in message.items:
            assert rid == request_id
            delta = isinstance(item, (OutputDelta, tuple))  # tuple: a GrowDelta
            got.append(decoder.decode(item) if delta else item)
            if not delta or (isinstance(item, OutputDelta) and item.finished):
                return got


@pytest.fixture
def replica(llama_path):
    engine = LLMEngine(EngineConfig(model=llama_path, block_size=4, max_model_len=128))
    ours, theirs = multiprocessing.Pipe()
    server = ReplicaServer(0, theirs, engine, ServerMetrics("m"))
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    yield ours, engine, thread
    ours.close()
    thread.join(10)
    server.shutdown()


def test_outputs_aborts_metrics_and_a_dying_engine(replica, monkeypatch):
    conn, engine, thread = replica
    decoder = OutputDecoder()
    params = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0)
    conn.send(Generate("a", {"prompt_token_ids": [1, 2, 3]}, params))
    outs = deliveries_until_end(conn, "a", decoder)
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5

    conn.send(Generate("long", {"prompt_token_ids": [4, 5]},
                       SamplingParams(max_tokens=100, ignore_eos=True)))
    conn.send(Abort("long"))
    ended = deliveries_until_end(conn, "long", decoder)
    assert ended[-1] is None  # aborted: a terminal None, not a finished output

    conn.send(Call(7, "metrics"))
    reply = receive(conn)
    assert isinstance(reply, Reply) and reply.call_id == 7 and reply.error is None
    families = {name: samples for name, _, _, _, samples in reply.value}
    [(_, _, tokens)] = [s for s in families["hitchllm:generation_tokens"]
                        if s[0].endswith("_total")]
    assert tokens >= 5
    conn.send(Call(8, "no_such_call"))
    assert receive(conn).error.kind == "invalid"

    def broken() -> list[Any]:
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(engine, "step", broken)  # the next step kills the engine loop
    conn.send(Generate("b", {"prompt_token_ids": [1]}, params))
    [failed] = deliveries_until_end(conn, "b", decoder)
    assert isinstance(failed, WireError) and failed.kind == "dead"
    assert "secret" not in failed.message
    dead = receive(conn)
    assert isinstance(dead, Dead) and "RuntimeError" in dead.reason
    thread.join(10)
    assert not thread.is_alive()  # the replica stopped serving
