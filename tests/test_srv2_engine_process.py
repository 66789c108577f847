"""The engine process behind ``hitchllm serve`` (``--engine-process``, the default): deltas
cross the pipe with every field, a request aborted while its grammar compiles never runs and
ends with a terminal delivery, a grammar that fails to compile fails its request alone, and
the command line picks the mode. (Streams equal to the offline engine's tokens:
test_srv_streaming.py, both modes; beam search through the process:
test_beam_search_server.py.)"""

from __future__ import annotations

import multiprocessing
import pickle
import threading
import time
from typing import Any

import pytest

from hitchllm.config import EngineConfig
from hitchllm.data_parallel.deltas import (
    OutputDecoder,
    OutputDelta,
    OutputEncoder,
    SequenceDelta,
)
from hitchllm.data_parallel.messages import Abort, Deliveries, Generate, WireError
from hitchllm.data_parallel.pipe_engine import ReplicaServer
from hitchllm.engine.llm_engine import LLMEngine
from hitchllm.entrypoints.openai.metrics import ServerMetrics
from hitchllm.outputs import CompletionOutput, RequestOutput
from hitchllm.sampling_params import SamplingParams


def test_deltas_pickle_with_every_field():
    seq = SequenceDelta(1, 2, "ab", 3, [4, 5], 6, [{4: None}], "stop", "</s>", -1.5)
    delta = OutputDelta("r", True, [seq], 7, {"arrival_time": 1.0}, "oops",
                        ("p", [1, 2], [None]), {"remote_block_ids": [3]})
    back = pickle.loads(pickle.dumps(delta))
    assert back == delta
    assert back.sequences[0] == seq and back.sequences[0] is not seq


def test_kv_transfer_params_reach_the_server():
    out = RequestOutput("r", None, [1, 2], [CompletionOutput(0, "x", [3], "length")],
                        finished=True, kv_transfer_params={"remote_block_ids": [9]})
    wire = pickle.loads(pickle.dumps(OutputEncoder().encode(out)))
    assert OutputDecoder().decode(wire).kv_transfer_params == {"remote_block_ids": [9]}


@pytest.fixture
def replica(llama_path, monkeypatch):
    """A replica's pipe side in this process, whose engine 'compiles' a grammar for every
    request of max_tokens 7 once ``release`` is set (failing for seed 0), and has no plugin
    for requests of max_tokens 5."""
    engine = LLMEngine(EngineConfig(model=llama_path, block_size=4, max_model_len=128))
    release = threading.Event()
    compiled: list[Any] = []

    def compile_logits_processors(params: SamplingParams, processors: Any = None) -> None:
        if params.max_tokens != 7:
            return
        assert release.wait(30)
        compiled.append(params)
        if params.seed == 0:
            raise ValueError("grammar: cannot compile")

    def logits_processors_for(params: SamplingParams) -> list[Any]:
        if params.max_tokens == 5:
            raise ValueError("structured_outputs needs the plugin no-such-plugin")
        return [object()] if params.max_tokens == 7 else []

    monkeypatch.setattr(engine, "logits_processors_for", logits_processors_for)
    monkeypatch.setattr(engine, "compile_logits_processors", compile_logits_processors)
    ours, theirs = multiprocessing.Pipe()
    server = ReplicaServer(0, theirs, engine, ServerMetrics("m"))
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    yield ours, engine, release, compiled, server
    ours.close()
    thread.join(10)
    server.shutdown()


def _next_delivery(conn: Any) -> tuple[str, Any]:
    assert conn.poll(30), "the replica did not answer"
    message = conn.recv()
    assert isinstance(message, Deliveries)
    [item] = message.items
    return item


def test_an_abort_while_the_grammar_compiles_ends_the_request_unrun(replica):
    conn, engine, release, compiled, server = replica
    conn.send(Generate("g", {"prompt_token_ids": [1, 2, 3]},
                       SamplingParams(max_tokens=7, seed=1)))
    conn.send(Abort("g"))
    deadline = time.monotonic() + 30
    while "g" not in server._cancelled:  # the abort has been read, the compile still runs
        assert time.monotonic() < deadline
        time.sleep(0.01)
    release.set()
    assert _next_delivery(conn) == ("g", None)  # terminal: the server's decoder forgets it
    assert len(compiled) == 1
    assert not engine.has_unfinished_requests()
    # The replica goes on serving: a plain request runs to its end.
    conn.send(Generate("p", {"prompt_token_ids": [1, 2]},
                       SamplingParams(max_tokens=3, ignore_eos=True, temperature=0)))
    decoder, out = OutputDecoder(), None
    while out is None or not out.finished:
        rid, delta = _next_delivery(conn)
        assert rid == "p"
        out = decoder.decode(delta)
    assert len(out.outputs[0].token_ids) == 3


def test_a_grammar_that_fails_to_compile_fails_its_request_alone(replica):
    conn, engine, release, _, _ = replica
    release.set()
    conn.send(Generate("bad", {"prompt_token_ids": [1]}, SamplingParams(max_tokens=7, seed=0)))
    rid, error = _next_delivery(conn)
    assert rid == "bad" and isinstance(error, WireError) and error.kind == "invalid"
    assert "cannot compile" in error.message
    conn.send(Generate("none", {"prompt_token_ids": [1]}, SamplingParams(max_tokens=5)))
    rid, error = _next_delivery(conn)
    assert rid == "none" and error.kind == "invalid" and "no-such-plugin" in error.message
    assert not engine.has_unfinished_requests()


def test_serve_runs_the_engine_in_a_process_on_cuda_unless_told_otherwise(monkeypatch):
    import torch

    from hitchllm.entrypoints.cli import build_parser
    from hitchllm.entrypoints.openai.api_server import use_engine_process

    parse = build_parser().parse_args
    assert parse(["serve"]).engine_process is None
    assert parse(["serve", "--engine-process"]).engine_process is True
    assert parse(["serve", "--no-engine-process"]).engine_process is False
    cpu, auto = EngineConfig(device="cpu"), EngineConfig(device="auto")
    assert use_engine_process(cpu, None) is False
    assert use_engine_process(cpu, True) is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert use_engine_process(auto, None) is True
    assert use_engine_process(EngineConfig(device="cuda:1"), None) is True
    assert use_engine_process(auto, False) is False


def test_serve_vs_offline_summarizes_each_server_mode_over_rounds():
    import importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        bench = importlib.import_module("serve_vs_offline")
    finally:
        sys.path.pop(0)
    base = {"output_tok_per_s": 100.0, "tpot_p50_ms": 10.0, "ttft_p50_ms": 1.0,
            "ttft_p99_ms": 2.0, "tpot_p90_ms": 11.0, "tpot_p99_ms": 12.0, "itl_p50_ms": 9.5,
            "itl_p99_ms": 30.0}

    def side(tok_s: float, tpot: float) -> dict[str, float]:
        return {**base, "output_tok_per_s": tok_s, "tpot_p50_ms": tpot}

    rounds = [(base, {"engine-thread": side(50, 20), "engine-process": side(90, 11)}),
              (side(200, 5), {"engine-thread": side(120, 8), "engine-process": side(190, 5)}),
              (base, {"engine-thread": side(70, 14), "engine-process": side(80, 12)})]
    assert bench.recorded_command(["--num-prompts", "8", "--", "--model", "/x/m", "--dtype",
                                   "bfloat16"]) == ("python benchmarks/serve_vs_offline.py "
                                                    "--num-prompts 8 -- --model MODEL_DIR "
                                                    "--dtype bfloat16")
    table = bench.summary(rounds).splitlines()
    assert table[2] == "| engine-thread | 3 | 0.600 (0.500-0.700) | 1.600 (1.400-2.000) |"
    assert table[3] == "| engine-process | 3 | 0.900 (0.800-0.950) | 1.100 (1.000-1.200) |"
    rows = bench.report(rounds).splitlines()
    assert rows[3].startswith("| 1 | served, engine-thread | 50.0 |")
    assert rows[3].endswith("| 9.50/30.00 | 0.500 | 2.000 |")


def test_a_failure_while_the_engine_process_loads_stops_it(monkeypatch, llama_path):
    """The engine process starts before the server imports its HTTP stack and loads the
    tokenizer (they overlap its loading); if that fails, the engine process is stopped."""
    import signal

    from hitchllm.entrypoints.openai import api_server

    calls: list[str] = []

    class Starting:
        def wait_ready(self) -> None:
            calls.append("wait_ready")

        def shutdown(self) -> None:
            calls.append("shutdown")

    def start_engines(*args: Any, **kwargs: Any) -> tuple[Starting, None]:
        calls.append("start")
        return Starting(), None

    def no_tokenizer(*args: Any, **kwargs: Any) -> None:
        calls.append("tokenizer")
        raise OSError("no tokenizer here")

    monkeypatch.setattr(api_server, "_start_engines", start_engines)
    monkeypatch.setattr(api_server, "load_tokenizer", no_tokenizer)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(OSError, match="no tokenizer here"):
            api_server.serve(EngineConfig(model=llama_path))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert calls == ["start", "tokenizer", "shutdown"]
