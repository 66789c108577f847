"""Disaggregated prefill/decode on GPUs: the producer's KV reaches the consumer through each
connector, and greedy tokens equal one ordinary engine's on the same card type. float32, so
that the consumer's last prompt token (computed alone, where the reference computes it inside
the prompt's batch) cannot flip a near-tie of the random model's logits."""

from __future__ import annotations

import pytest
import torch
from server_process import free_port
from test_kvx_engine import GREEDY, PROMPTS, kv_config, prefill, run, tokens

from hitchllm.config import EngineConfig
from hitchllm.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.gpu
ENGINE = dict(num_kv_blocks=64, block_size=16, max_model_len=256, dtype="float32",
              enforce_eager=True)


def engine(model: str, device: str, kv: dict | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, device=device, **ENGINE, kv_transfer_config=kv))


@pytest.fixture(scope="module")
def reference(llama_path):
    ref = engine(llama_path, "cuda:0")
    yield tokens(run(ref, PROMPTS, GREEDY))
    ref.close()


def check_pair(producer: LLMEngine, consumer: LLMEngine, reference) -> None:
    try:
        got = run(consumer, PROMPTS, GREEDY, prefill(producer))
        assert tokens(got) == reference
        stats = consumer.stats()
        assert stats.num_prompt_tokens_computed == len(PROMPTS)
        assert stats.kv_transfer.num_loads == len(PROMPTS) and stats.kv_load_fallbacks == 0
        assert consumer.kv_cache.num_free_blocks == consumer.num_kv_blocks
    finally:
        producer.close()
        consumer.close()


def test_shared_memory_connector_on_one_gpu(llama_path, tmp_path, reference):
    check_pair(engine(llama_path, "cuda:0", kv_config("shared_memory", "producer",
                                                      path=str(tmp_path))),
               engine(llama_path, "cuda:0", kv_config("shared_memory", "consumer")), reference)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_connector_between_two_gpus(llama_path, reference):
    port = free_port()
    check_pair(engine(llama_path, "cuda:0", kv_config("torch_distributed", "producer",
                                                      port=port, backend="nccl")),
               engine(llama_path, "cuda:1", kv_config("torch_distributed", "consumer",
                                                      port=port, backend="nccl")), reference)
