"""``DataParallelEngine`` driven directly (no HTTP): explicit aborts, a replica that dies
with no other left, a replica that cannot start, and which devices and threads each replica
is given."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading

import pytest
import torch

from hitchllm.config import EngineConfig
from hitchllm.data_parallel.client import DataParallelEngine
from hitchllm.data_parallel.placement import replica_environments
from hitchllm.engine.async_engine import EngineDeadError
from hitchllm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def one_replica(llama_path):
    stopped = threading.Event()
    engine = DataParallelEngine(EngineConfig(model=llama_path, block_size=4, max_model_len=256),
                                1, "tiny", on_all_dead=stopped.set, start_timeout_s=120)
    yield engine, stopped
    engine.shutdown()
    assert not engine.replicas[0].process.is_alive()


def test_abort_ends_the_stream_with_a_finished_output(one_replica):
    engine, _ = one_replica

    async def main():
        params = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0)
        outputs = []
        async for out in engine.generate({"prompt_token_ids": [5, 6, 7]}, params,
                                         request_id="to-abort"):
            outputs.append(out)
            if len(outputs) == 2:
                engine.abort("to-abort")
        return outputs

    outputs = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    assert len(outputs[-1].outputs[0].token_ids) < 200
    assert engine.balancer.load == [0]


def test_a_rejected_request_is_a_value_error_and_the_replica_goes_on(one_replica):
    engine, _ = one_replica

    async def run(prompt, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return [out async for out in engine.generate(prompt, params)]

    with pytest.raises(ValueError, match="max_model_len"):
        asyncio.run(asyncio.wait_for(run({"prompt_token_ids": [1] * 300}, 4), timeout=60))
    outputs = asyncio.run(asyncio.wait_for(run({"prompt_token_ids": [1, 2]}, 4), timeout=60))
    assert len(outputs[-1].outputs[0].token_ids) == 4


def test_the_last_replica_dying_fails_requests_and_stops_serving(one_replica):
    """Runs last in this module: it kills the replica."""
    engine, stopped = one_replica

    async def main():
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        async for _ in engine.generate({"prompt_token_ids": [5, 6, 7]}, params):
            os.kill(engine.replicas[0].process.pid, signal.SIGKILL)

    with pytest.raises(EngineDeadError, match=r"replica 0 stopped: .*exited with code -9"):
        asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert stopped.wait(10)
    assert "replica 0 stopped" in engine.dead_reason
    with pytest.raises(EngineDeadError, match="replica 0"):
        asyncio.run(asyncio.wait_for(main(), timeout=10))
    # /metrics still renders; one engine process has no balancer families (a one-engine
    # server's metrics).
    assert "hitchllm:data_parallel_replica_up" not in engine.metrics.render().decode()


def test_a_replica_that_cannot_start_is_an_error_and_leaves_no_process(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    # A configuration error stays a ValueError, which the command line prints as one line.
    with pytest.raises(ValueError, match="replica 0 failed to start: .*no 'architectures'"):
        DataParallelEngine(EngineConfig(model=str(tmp_path)), 1, start_timeout_s=120)
    assert not [p for p in multiprocessing.active_children()
                if p.name.startswith("hitchllm-dp-replica")]


def test_each_replica_gets_its_own_gpus_or_its_share_of_cores(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    cuda = EngineConfig(device="cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6")
    assert replica_environments(cuda, 3) == [{"CUDA_VISIBLE_DEVICES": d} for d in "356"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert replica_environments(cuda, 2) == [{"CUDA_VISIBLE_DEVICES": "0"},
                                             {"CUDA_VISIBLE_DEVICES": "1"}]
    with pytest.raises(ValueError, match="need 5 GPUs, but 4 are visible"):
        replica_environments(cuda, 5)
    with pytest.raises(ValueError, match="pins one GPU"):
        replica_environments(EngineConfig(device="cuda:1"), 2)
    # One engine process (hitchllm serve's default) uses what this process would have.
    assert replica_environments(EngineConfig(device="cuda:1"), 1) == [{}]
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("hitchllm.data_parallel.placement.usable_cpus", lambda: 8)
    cpu = EngineConfig(device="cpu")
    assert replica_environments(cpu, 2) == [{"OMP_NUM_THREADS": "4"}] * 2
    assert replica_environments(cpu, 16) == [{"OMP_NUM_THREADS": "1"}] * 16
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice stands
    assert replica_environments(cpu, 2) == [{}, {}]


def test_the_command_line_takes_the_replica_count_only_for_serve(capsys, llama_path):
    from hitchllm.entrypoints import cli

    assert cli.main(["serve", llama_path, "-dp", "0"]) == 2
    assert "--data-parallel-size must be at least 1, got 0" in capsys.readouterr().err
    assert cli.main(["generate", "--model", llama_path, "--data-parallel-size", "2",
                     "--prompt", "x"]) == 2
    assert "hitchllm serve --data-parallel-size N" in capsys.readouterr().err
    args = cli.build_parser().parse_args(["serve", "--data-parallel-size", "3"])
    assert args.data_parallel_size == 3


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_replicas_on_two_gpus_answer_like_one_engine(llama_path):
    from hitchllm import LLM

    kwargs = {"device": "cuda", "block_size": 16, "max_model_len": 256}
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [i, i + 1, i + 2]} for i in range(1, 5)]
    engine = DataParallelEngine(EngineConfig(model=llama_path, **kwargs), 2, "tiny",
                                start_timeout_s=300)
    try:
        gpus = [r.gpus for r in engine.ready]
        assert [len(g) for g in gpus] == [1, 1] and gpus[0] != gpus[1]  # a GPU each

        async def run(prompt):
            return [out async for out in engine.generate(prompt, params)][-1]

        got = [asyncio.run(asyncio.wait_for(run(p), 300)).outputs[0].token_ids
               for p in prompts]
        assert engine.balancer.routed == [2, 2]
    finally:
        engine.shutdown()
    llm = LLM(llama_path, **kwargs)
    assert got == [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                 use_tqdm=False)]
