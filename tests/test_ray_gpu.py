"""The Ray executor on 2 GPUs (NCCL, one actor per card in a STRICT_PACK placement group):
TP=2 on Ray generates what TP=1 does, with the decode CUDA graphs. Run on the GPU machine
with 2 cards and Ray installed; skipped elsewhere."""

from __future__ import annotations

import time

import pytest
import torch
from ray_support import import_ray_or_skip, wait_gone
from test_models_hf_parity import mixed_prompts
from test_tp_gpu import SHAPES, greedy_tokens

from hitchllm import LLM
from hitchllm.engine.ray_executor import RayExecutor
from hitchllm.tiny_model import build_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


@pytest.fixture(scope="module")
def gpu_ray_cluster():
    """A local Ray instance with this machine's first 2 GPUs, shut down after the module."""
    ray = import_ray_or_skip()
    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False,
             log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def test_tp2_on_ray_matches_tp1_on_two_gpus(gpu_ray_cluster, tmp_path, auto_backend):
    ray = gpu_ray_cluster
    path = str(build_tiny_checkpoint(tmp_path / "llama", "LlamaForCausalLM",
                                     **SHAPES["LlamaForCausalLM"]))
    prompts = mixed_prompts(6)  # a decode batch of 6: padded to a captured graph size
    engine = dict(device="cuda", dtype="float32", block_size=16, max_model_len=256,
                  gpu_memory_utilization=0.5)
    with LLM(path, **engine) as llm:
        expected = greedy_tokens(llm, prompts)
    with LLM(path, tensor_parallel_size=2, distributed_executor_backend="ray",
             **engine) as llm:
        assert isinstance(llm.engine.executor, RayExecutor)
        pids = llm.engine.executor.pids
        assert greedy_tokens(llm, prompts) == expected  # decode steps replay graphs
    assert wait_gone(pids) == []
    deadline = time.monotonic() + 10  # the placement group's removal frees its GPUs
    while ray.available_resources().get("GPU") != 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("GPU") == 2
