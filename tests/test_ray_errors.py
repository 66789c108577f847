"""Ray executor errors that need no Ray cluster: Ray not installed, and the Ray flags reaching
the engine config."""

from __future__ import annotations

import multiprocessing
import sys

import pytest

from hitchllm import LLM
from hitchllm.config import EngineConfig
from hitchllm.entrypoints.cli import build_parser, engine_kwargs


def test_ray_not_installed_says_how_to_install_it(llama_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    before = multiprocessing.active_children()
    with pytest.raises(ImportError, match=r"distributed_executor_backend='ray' needs Ray, "
                                          r"which is not installed: pip install "
                                          r"'hitchllm\[ray\]'"):
        LLM(llama_path, tensor_parallel_size=2, distributed_executor_backend="ray")
    assert multiprocessing.active_children() == before


def test_speculative_decoding_on_ray_is_refused(llama_path):
    with pytest.raises(ValueError, match=r"speculative decoding \(speculative_method\) does "
                                         "not run on Ray workers yet"):
        LLM(llama_path, distributed_executor_backend="ray", speculative_method="ngram",
            num_speculative_tokens=2)


def test_ray_flags_reach_the_engine_config(llama_path):
    args = build_parser().parse_args([
        "generate", "--model", llama_path, "--prompt", "x", "-tp", "2",
        "--distributed-executor-backend", "ray", "--ray-placement-strategy", "SPREAD",
        "--ray-placement-timeout-s", "5"])
    config = EngineConfig(model=llama_path, **engine_kwargs(args))
    assert config.distributed_executor_backend == "ray"
    assert config.ray_placement_strategy == "SPREAD"
    assert config.ray_placement_timeout_s == 5
    with pytest.raises(ValueError, match="ray_placement_strategy"):
        EngineConfig(model=llama_path, ray_placement_strategy="EVERYWHERE")
