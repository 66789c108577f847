"""A tensor-parallel engine whose worker dies, hangs or fails to start raises an error that
names the rank, within a bounded time, and leaves no worker process behind."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file, save_file
from tp_support import TP_TEST_TIMEOUT_S, alive, only_builtin_plugins, tp_llm  # noqa: F401

from hitchllm import LLM, SamplingParams
from hitchllm.engine.executor import WorkerFailedError

ENGINE = dict(dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=64,
              tensor_parallel_size=2)


def start_requests(llm: LLM, n: int = 2) -> None:
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for i in range(n):
        llm.engine.add_request({"prompt_token_ids": [1 + i, 2, 3, 4]}, params)


def step_until_error(llm: LLM, limit_s: float) -> tuple[BaseException, float]:
    start = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        while time.monotonic() - start < limit_s:
            llm.engine.step()
    return info.value, time.monotonic() - start


def test_a_killed_worker_fails_the_engine_naming_its_rank(llama_path,
                                                          only_builtin_plugins):  # noqa: F811
    with tp_llm(llama_path, **ENGINE) as llm:
        pids = llm.engine.executor.pids
        start_requests(llm)
        for _ in range(3):  # mid-run: requests are being decoded
            llm.engine.step()
        os.kill(pids[1], signal.SIGKILL)
        error, took = step_until_error(llm, TP_TEST_TIMEOUT_S)
        assert re.search(r"tensor-parallel rank 1 \(pid \d+\) died in .+ \(killed by signal 9\)",
                         str(error)), str(error)
        assert error.rank == 1
        assert took < 10
        # The executor stopped every worker; the engine refuses further steps.
        assert llm.engine.executor.pids == []
        assert not any(alive(pid) for pid in pids)
        with pytest.raises(WorkerFailedError, match="stopped"):
            llm.engine.step()


def test_a_hung_worker_fails_the_engine_after_the_step_timeout(llama_path,
                                                               only_builtin_plugins):  # noqa: F811
    # Without async scheduling no step is in flight once step() returns, so rank 1 is stopped
    # before it can read the next call (with one in flight both ranks may have read it, and
    # then neither can be blamed alone).
    with tp_llm(llama_path, worker_step_timeout_s=2, async_scheduling=False, **ENGINE) as llm:
        pids = llm.engine.executor.pids
        start_requests(llm)
        llm.engine.step()
        os.kill(pids[1], signal.SIGSTOP)  # alive but never answers; rank 0 waits for it
        try:
            error, took = step_until_error(llm, TP_TEST_TIMEOUT_S)
        finally:
            if alive(pids[1]):
                os.kill(pids[1], signal.SIGCONT)
        # Rank 1 never read the step; rank 0 did and waits for rank 1 in the all-reduce.
        assert ("rank(s) 1 stopped taking calls and did not answer" in str(error)
                and "within 2 s (hung); rank(s) 0 wait for them in a collective" in str(error))
        assert error.rank == 1
        assert 2 <= took < 30  # generous: a loaded 2-core machine is slow to stop workers
        assert not any(alive(pid) for pid in pids)


def test_a_worker_that_fails_to_start_raises_its_error_and_stops_the_others(
        llama_path, tmp_path, only_builtin_plugins):  # noqa: F811
    broken = tmp_path / "broken"
    shutil.copytree(llama_path, broken)
    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, broken / "model.safetensors")
    before = set(_children())
    start = time.monotonic()
    with pytest.raises(ValueError, match="down_proj") as info:
        LLM(str(broken), **ENGINE)
    assert time.monotonic() - start < TP_TEST_TIMEOUT_S
    # The first rank to fail is reported (both fail alike here), with its traceback.
    assert any(re.match(r"raised by tensor-parallel rank [01] in start-up", note)
               and "load_named_weights" in note for note in info.value.__notes__)
    assert set(_children()) <= before  # every worker process reaped


def _children() -> list[int]:
    """The ids of this process's live child processes."""
    import multiprocessing

    return [p.pid for p in multiprocessing.active_children() if p.pid is not None]


EXIT_SCRIPT = """
import sys
from hitchllm import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(sys.argv[1], dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=64,
              tensor_parallel_size=2)
    print(*llm.engine.executor.pids, flush=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2),
                 use_tqdm=False)
    # Exits without closing the LLM.
"""


def test_a_script_that_never_closes_its_engine_still_stops_the_workers_at_exit(
        llama_path, tmp_path, only_builtin_plugins):  # noqa: F811
    script = tmp_path / "never_closes.py"
    script.write_text(EXIT_SCRIPT)
    done = subprocess.run([sys.executable, str(script), llama_path], capture_output=True,
                          text=True, timeout=TP_TEST_TIMEOUT_S, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 2
    assert not any(alive(pid) for pid in pids)


UNGUARDED_SCRIPT = """
import sys
from hitchllm import LLM

LLM(sys.argv[1], dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=64,
    tensor_parallel_size=2)
"""


def test_a_script_without_a_main_guard_is_told_to_add_one(llama_path, tmp_path,
                                                          only_builtin_plugins):  # noqa: F811
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT)
    done = subprocess.run([sys.executable, str(script), llama_path], capture_output=True,
                          text=True, timeout=TP_TEST_TIMEOUT_S, cwd=tmp_path)
    assert done.returncode != 0
    assert "WorkerFailedError: tensor-parallel rank" in done.stderr
    assert "died in start-up" in done.stderr
    assert 'needs an `if __name__ == "__main__":` guard' in done.stderr
