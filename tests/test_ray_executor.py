"""The Ray executor on a local Ray cluster (CPU, gloo, 2 actors): TP=2 on Ray generates what
one process does; a killed actor fails the engine naming its rank; a placement group the
cluster cannot grant fails with what the cluster has instead of waiting forever. Every test
leaves no actor and no placement group behind."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import time

import pytest
from ray_support import (  # noqa: F401 (fixtures)
    CLUSTER_CPUS,
    RAY_TEST_TIMEOUT_S,
    import_ray_or_skip,
    ray_cluster,
    ray_test_timeout,
    wait_gone,
)
from safetensors.torch import load_file, save_file
from tp_support import only_builtin_plugins  # noqa: F401

from hitchllm import LLM, SamplingParams
from hitchllm.engine.executor import WorkerFailedError
from hitchllm.engine.ray_executor import RayExecutor

import_ray_or_skip()
pytestmark = pytest.mark.usefixtures("ray_test_timeout")

ENGINE = dict(dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=96,
              max_num_batched_tokens=16, distributed_executor_backend="ray",
              worker_step_timeout_s=30)
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 47)), [300, 7, 7, 7, 9, 12, 200, 5, 1]]
MAX_TOKENS = 8


def generate(llm: LLM) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
              # Seeded sampling: every rank samples alike (the executor compares digests).
              SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True)]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def placement_groups_left(ray) -> list[str]:
    return [pg_id for pg_id, info in ray.util.placement_group_table().items()
            if info["state"] != "REMOVED"]


def test_tp2_on_ray_generates_what_tp1_generates(ray_cluster, llama_path,  # noqa: F811
                                                 only_builtin_plugins):  # noqa: F811
    ray = ray_cluster
    # Chunked prefill (the 37-token prompt takes three steps) under async scheduling: each
    # actor launches a step before it answers the one before.
    expected = generate(LLM(llama_path, **{k: v for k, v in ENGINE.items()
                                           if k != "distributed_executor_backend"}))
    start = time.monotonic()
    with LLM(llama_path, tensor_parallel_size=2, **ENGINE) as llm:
        executor = llm.engine.executor
        assert isinstance(executor, RayExecutor)
        pids = executor.pids
        assert len(set(pids)) == 2 and os.getpid() not in pids  # two actor processes
        assert executor.kv_cache_specs[0].num_kv_heads == 1  # each rank its KV head
        assert generate(llm) == expected
    assert time.monotonic() - start < RAY_TEST_TIMEOUT_S
    assert all(len(t) == MAX_TOKENS for t in expected)
    # close() killed the actors and removed the placement group; the cluster is ours.
    assert wait_gone(pids) == []
    assert placement_groups_left(ray) == []
    assert ray.is_initialized()


def test_a_killed_actor_fails_the_engine_naming_its_rank(ray_cluster, llama_path,  # noqa: F811
                                                         only_builtin_plugins):  # noqa: F811
    ray = ray_cluster
    with LLM(llama_path, tensor_parallel_size=2, **ENGINE) as llm:
        pids = llm.engine.executor.pids
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        for i in range(2):
            llm.engine.add_request({"prompt_token_ids": [1 + i, 2, 3, 4]}, params)
        for _ in range(3):  # mid-run: the requests are being decoded
            llm.engine.step()
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerFailedError) as info:
            while time.monotonic() - start < RAY_TEST_TIMEOUT_S:
                llm.engine.step()
        took = time.monotonic() - start
        error = info.value
        assert re.search(rf"tensor-parallel rank 1 \(Ray actor, pid {pids[1]}\) died in step "
                         r"\d+: ", str(error)), str(error)
        assert error.rank == 1
        assert took < 20
        # Every actor was stopped (rank 0 waited in a collective for rank 1); the engine
        # refuses further steps.
        assert llm.engine.executor.pids == []
        with pytest.raises(WorkerFailedError, match="stopped"):
            llm.engine.step()
    assert wait_gone(pids) == []
    assert placement_groups_left(ray) == []


def test_a_hung_actor_fails_the_engine_after_the_step_timeout(ray_cluster, llama_path,  # noqa: F811
                                                              only_builtin_plugins):  # noqa: F811
    ray = ray_cluster
    with LLM(llama_path, tensor_parallel_size=2, **dict(ENGINE, worker_step_timeout_s=2)) as llm:
        pids = llm.engine.executor.pids
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        llm.engine.add_request({"prompt_token_ids": [1, 2, 3, 4]}, params)
        llm.engine.step()
        os.kill(pids[1], signal.SIGSTOP)  # alive but never answers; rank 0 waits for it
        start = time.monotonic()
        try:
            with pytest.raises(WorkerFailedError) as info:
                while time.monotonic() - start < RAY_TEST_TIMEOUT_S:
                    llm.engine.step()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[1], signal.SIGCONT)
        took = time.monotonic() - start
        # Rank 0 waits for rank 1 in the all-reduce: neither answers, neither alone is blamed.
        assert re.search(r"tensor-parallel rank\(s\) 0, 1 did not answer step \d+ within 2 s "
                         r"\(hung, or waiting in a collective", str(info.value)), str(info.value)
        assert info.value.rank is None
        assert 2 <= took < 12
    assert wait_gone(pids) == []  # the stopped actor was killed too
    assert placement_groups_left(ray) == []


def test_a_placement_group_the_cluster_cannot_grant_fails_in_time(ray_cluster,  # noqa: F811
                                                                  llama_path):
    ray = ray_cluster
    start = time.monotonic()
    message = (f"the Ray cluster did not grant tensor_parallel_size=4 bundles of {{'CPU': 1}} "
               f"(placement strategy STRICT_PACK) within 1 s: it has {CLUSTER_CPUS} CPU in "
               f"total, {CLUSTER_CPUS} free now (per node: ")
    with pytest.raises(RuntimeError, match=re.escape(message)) as info:
        LLM(llama_path, tensor_parallel_size=4, ray_placement_timeout_s=1, **ENGINE)
    assert "lower tensor_parallel_size" in str(info.value)
    assert "ray_placement_strategy='PACK' or 'SPREAD'" in str(info.value)
    assert time.monotonic() - start < 15
    assert placement_groups_left(ray) == []


def test_an_actor_that_fails_to_start_raises_its_error_and_frees_the_cluster(
        ray_cluster, llama_path, tmp_path, only_builtin_plugins):  # noqa: F811
    ray = ray_cluster
    broken = tmp_path / "broken"
    shutil.copytree(llama_path, broken)
    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, broken / "model.safetensors")
    with pytest.raises(ValueError, match="down_proj") as info:
        LLM(str(broken), tensor_parallel_size=2, **ENGINE)
    # The first rank to fail is reported (both fail alike here), with its traceback.
    assert any(re.match(r"raised by tensor-parallel rank [01] in start-up", note)
               and "load_named_weights" in note for note in info.value.__notes__)
    assert placement_groups_left(ray) == []
    deadline = time.monotonic() + 10  # the actors' CPUs go back to the cluster
    while ray.available_resources().get("CPU") != CLUSTER_CPUS and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU") == CLUSTER_CPUS
