"""Tensor-parallel configurations that cannot run are refused at start-up, before any worker
process starts, each with one error that says what to change; the flags reach the config."""

from __future__ import annotations

import dataclasses
import multiprocessing

import pytest
import torch
import torch.distributed as dist

from hitchllm import LLM
from hitchllm.config import EngineConfig, ModelConfig
from hitchllm.engine.tensor_parallel import check_tensor_parallel, heads_per_rank
from hitchllm.entrypoints.cli import build_parser, engine_kwargs


@pytest.fixture
def model_config(llama_path) -> ModelConfig:
    return ModelConfig.from_pretrained(llama_path)  # 4 query heads, 2 KV heads


def shaped(config: ModelConfig, heads: int, kv_heads: int) -> ModelConfig:
    return dataclasses.replace(config, num_attention_heads=heads, num_key_value_heads=kv_heads)


@pytest.mark.parametrize("heads, kv_heads, tp, expected", [
    (4, 2, 2, (2, 1)),   # both split
    (4, 2, 4, (1, 1)),   # 2 KV heads, each replicated on 2 ranks
    (8, 1, 4, (2, 1)),   # one KV head on every rank
    (4, 4, 1, (4, 4)),
])
def test_heads_per_rank_split_and_replicate(model_config, heads, kv_heads, tp, expected):
    assert heads_per_rank(shaped(model_config, heads, kv_heads), tp) == expected


@pytest.mark.parametrize("heads, kv_heads, tp, message", [
    (4, 2, 3, "tensor_parallel_size=3 does not divide the model's 4 attention heads; use a "
              "tensor_parallel_size that divides 4 (1, 2, 4)"),
    (6, 3, 2, "tensor_parallel_size=2 does not divide the model's 3 key/value heads"),
    (12, 4, 6, "4 key/value heads cannot be replicated evenly over tensor_parallel_size=6"),
])
def test_a_split_that_does_not_divide_is_refused(model_config, heads, kv_heads, tp, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        heads_per_rank(shaped(model_config, heads, kv_heads), tp)


def test_the_engine_refuses_before_starting_any_worker(llama_path):
    before = multiprocessing.active_children()
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        LLM(llama_path, tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"speculative decoding \(speculative_method\) does "
                                         "not run with tensor_parallel_size > 1 yet"):
        LLM(llama_path, tensor_parallel_size=2, speculative_method="ngram",
            num_speculative_tokens=2)
    assert multiprocessing.active_children() == before


def cuda_config(llama_path, **kwargs) -> EngineConfig:
    return EngineConfig(model=llama_path, tensor_parallel_size=2, **kwargs)


def test_more_ranks_than_gpus_is_refused(llama_path, model_config, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs 2 GPUs .one per rank. "
                                         "but 1 is visible; lower tensor_parallel_size to at "
                                         "most 1, make more cards visible .CUDA_VISIBLE_DEVICES.,"
                                         " or run the ranks as CPU processes with "
                                         "device='cpu'"):
        check_tensor_parallel(cuda_config(llama_path), model_config, torch.device("cuda"))


def test_tensor_parallelism_on_cuda_without_nccl_is_refused(llama_path, model_config,
                                                             monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    with pytest.raises(ValueError, match="needs NCCL, which this PyTorch build lacks; install "
                                         "a PyTorch build with NCCL"):
        check_tensor_parallel(cuda_config(llama_path), model_config, torch.device("cuda"))


def test_one_named_card_with_several_ranks_is_refused(llama_path, model_config):
    with pytest.raises(ValueError, match="use device='cuda' and choose the cards with "
                                         "CUDA_VISIBLE_DEVICES"):
        check_tensor_parallel(cuda_config(llama_path), model_config, torch.device("cuda", 1))


def test_tensor_parallel_flags_reach_the_engine_config(llama_path):
    for flags in (["-tp", "2"], ["--tensor-parallel-size", "2"]):
        args = build_parser().parse_args(["generate", "--model", llama_path, "--prompt", "x",
                                          *flags, "--distributed-executor-backend", "mp"])
        kwargs = engine_kwargs(args)
        assert kwargs["tensor_parallel_size"] == 2
        assert kwargs["distributed_executor_backend"] == "mp"
        assert EngineConfig(model=llama_path, **kwargs).tensor_parallel_size == 2
