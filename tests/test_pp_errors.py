"""Pipeline parallelism refuses what it cannot run before any worker starts, with what to
change; a stage that dies mid-run fails the engine with an error naming its rank and stage,
and no worker process is left behind."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
from mla_checkpoints import build_tiny_deepseek
from tp_support import TP_TEST_TIMEOUT_S, alive, only_builtin_plugins, tp_llm  # noqa: F401

from hitchllm import LLM, SamplingParams
from hitchllm.engine.executor import WorkerFailedError
from hitchllm.entrypoints.cli import build_parser, engine_kwargs
from hitchllm.scheduler.step_plan import NewRequestData, StepPlan

ENGINE = dict(dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=64)


def test_the_cli_flag_reaches_the_engine(llama_path):
    for flag in ("-pp", "--pipeline-parallel-size"):
        args = build_parser().parse_args(["generate", "--model", llama_path, "--prompt", "x",
                                          flag, "2", "-tp", "2"])
        assert engine_kwargs(args)["pipeline_parallel_size"] == 2
        assert engine_kwargs(args)["tensor_parallel_size"] == 2


def test_more_stages_than_layers_is_refused(llama_path, only_builtin_plugins):  # noqa: F811
    with pytest.raises(ValueError, match=r"^pipeline_parallel_size=3 is more than the model's "
                                         r"2 decoder layers \(each stage needs at least one\); "
                                         r"use at most 2$"):
        LLM(llama_path, pipeline_parallel_size=3, **ENGINE)


@pytest.mark.parametrize("feature, kwargs", [
    ("speculative decoding", dict(speculative_method="ngram", num_speculative_tokens=2)),
    ("LoRA", dict(enable_lora=True)),
])
def test_features_without_pipeline_support_are_refused(llama_path, feature, kwargs):
    with pytest.raises(ValueError, match=rf"^{feature} .* does not run with "
                                         r"pipeline_parallel_size > 1 yet; use "
                                         r"pipeline_parallel_size=1 or turn it off$"):
        LLM(llama_path, pipeline_parallel_size=2, **ENGINE, **kwargs)


def test_pipeline_stages_on_ray_are_refused(llama_path):
    with pytest.raises(ValueError, match=r"not on Ray yet; use pipeline_parallel_size=1 with "
                                         r"Ray, or the mp backend$"):
        LLM(llama_path, pipeline_parallel_size=2, distributed_executor_backend="ray", **ENGINE)


def test_a_model_that_cannot_be_split_is_refused(tmp_path):
    path = build_tiny_deepseek(tmp_path / "ds", "DeepseekV2ForCausalLM")
    with pytest.raises(ValueError, match=r"^DeepseekV2ForCausalLM \(.*\) cannot be split into "
                                         r"pipeline stages yet; use pipeline_parallel_size=1"):
        LLM(path, pipeline_parallel_size=2, **ENGINE)


def start_decoding(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for i in range(2):
        llm.engine.add_request({"prompt_token_ids": [1 + i, 2, 3, 4]}, params)
    for _ in range(3):  # mid-run: requests are being decoded
        llm.engine.step()


def step_until_error(llm: LLM) -> tuple[WorkerFailedError, float]:
    start = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        while time.monotonic() - start < TP_TEST_TIMEOUT_S:
            llm.engine.step()
    return info.value, time.monotonic() - start


def test_a_dead_stage_fails_the_engine_naming_its_rank(llama_path,
                                                       only_builtin_plugins):  # noqa: F811
    """Stage 0 dies while stage 1 waits to receive its activations: the error names the dead
    rank and its stage, and every worker is stopped."""
    with tp_llm(llama_path, pipeline_parallel_size=2, **ENGINE) as llm:
        pids = llm.engine.executor.pids
        start_decoding(llm)
        os.kill(pids[0], signal.SIGKILL)
        error, took = step_until_error(llm)
        assert took < 10
        assert re.search(r"^rank 0 \(pipeline stage 0, tensor-parallel rank 0\) \(pid \d+\) "
                         r"died in .+ \(killed by signal 9\)", str(error)), str(error)
        assert error.rank == 0
        assert llm.engine.executor.pids == []
        assert not any(alive(pid) for pid in pids)



def test_a_stage_that_raises_fails_the_engine_at_once_naming_its_rank(
        llama_path, only_builtin_plugins):  # noqa: F811
    """A step that raises on stage 0 (a token outside the vocabulary: only stage 0 embeds)
    never reaches stage 1, which would wait for its activations until the step timeout; the
    executor fails at once instead, naming the rank."""
    # Without the check, the step would end as hung after worker_step_timeout_s.
    with tp_llm(llama_path, pipeline_parallel_size=2, worker_step_timeout_s=20,
                **ENGINE) as llm:
        pids = llm.engine.executor.pids
        vocab = llm.engine.vocab_size
        plan = StepPlan(["bad"], [3], [0], [True], [[0]], [NewRequestData(
            "bad", [vocab + 5, 1, 2], SamplingParams(temperature=0, max_tokens=1))])
        start = time.monotonic()
        with pytest.raises(WorkerFailedError) as info:
            llm.engine.executor.execute_model(plan).result()
        assert time.monotonic() - start < 10  # not the 300 s step timeout
        assert str(info.value).startswith(
            "rank 0 (pipeline stage 0, tensor-parallel rank 0) raised IndexError in step ")
        assert "the later pipeline stages wait for its activations" in str(info.value)
        assert info.value.rank == 0
        assert not any(alive(pid) for pid in pids)
