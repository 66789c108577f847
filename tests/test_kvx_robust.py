"""What must not break a producer: a consumer that comes late, saves beyond the producer's
staging budget, a save that raises. Each time the producer goes on serving, its blocks come
back, and the consumer gets the KV or computes the prompt itself (same greedy tokens)."""

from __future__ import annotations

import logging
import socket
import time

import pytest
from server_process import free_port
from test_kvx_engine import ENGINE, GREEDY, PROMPTS, kv_config, prefill, reference, run, tokens

from hitchllm.config import EngineConfig
from hitchllm.data_parallel import client
from hitchllm.data_parallel.client import DataParallelEngine
from hitchllm.engine.llm_engine import LLMEngine

__all__ = ["reference"]  # a fixture used here


def pair(llama_path, port: int, producer_timeout_s: float, **options):
    producer = LLMEngine(EngineConfig(model=llama_path, **ENGINE, kv_transfer_config=kv_config(
        "torch_distributed", "producer", port=port, backend="gloo",
        kv_load_timeout_s=producer_timeout_s, **options)))
    return producer, lambda: LLMEngine(EngineConfig(
        model=llama_path, **ENGINE, kv_transfer_config=kv_config(
            "torch_distributed", "consumer", port=port, backend="gloo",
            kv_load_timeout_s=20)))


def test_the_producer_waits_for_a_consumer_that_comes_after_its_timeout(llama_path,
                                                                        reference):
    producer, start_consumer = pair(llama_path, free_port(), producer_timeout_s=0.5)
    consumer = None
    try:
        params = prefill(producer)
        time.sleep(1.5)  # three producer timeouts without a consumer
        consumer = start_consumer()
        got = run(consumer, PROMPTS, GREEDY, params)
        assert tokens(got) == reference
        assert consumer.stats().kv_transfer.num_loads == len(PROMPTS)
        assert consumer.stats().kv_load_fallbacks == 0
        assert producer.kv_cache.num_free_blocks == producer.num_kv_blocks
    finally:
        producer.close()
        if consumer is not None:
            consumer.close()


def test_saves_beyond_max_staged_gib_are_not_made_and_the_consumer_computes_at_once(
        llama_path, reference, caplog):
    caplog.set_level(logging.WARNING)
    producer, start_consumer = pair(llama_path, free_port(), producer_timeout_s=20,
                                    max_staged_gib=1e-9)
    consumer = start_consumer()
    try:
        params = prefill(producer)
        assert producer.stats().kv_transfer.num_saves == 0
        assert sum("not saving its KV" in r.message for r in caplog.records) == len(PROMPTS)
        start = time.monotonic()
        got = run(consumer, PROMPTS, GREEDY, params)
        assert time.monotonic() - start < 10  # answered "missing" at once, not at the timeout
        assert tokens(got) == reference
        assert consumer.stats().kv_load_fallbacks == len(PROMPTS)
        assert consumer.stats().kv_transfer.num_failed_loads == len(PROMPTS)
        assert producer.kv_cache.num_free_blocks == producer.num_kv_blocks
    finally:
        producer.close()
        consumer.close()


def test_a_save_that_raises_is_logged_and_the_producer_goes_on(llama_path, tmp_path,
                                                              reference, caplog):
    producer = LLMEngine(EngineConfig(model=llama_path, **ENGINE, kv_transfer_config=kv_config(
        "shared_memory", "producer", path=str(tmp_path))))
    connector = producer.executor.runner.kv_connector

    def out_of_memory(save):
        raise RuntimeError("CUDA out of memory (simulated)")

    connector.save = out_of_memory
    caplog.set_level(logging.ERROR, logger="hitchllm.kv_transfer.connector")
    try:
        outs = prefill(producer, PROMPTS[:2])
        assert len(outs) == 2
        assert sum("saving its KV failed" in r.message for r in caplog.records) == 2
        # The engine still serves, and its blocks are whole.
        assert tokens(run(producer, PROMPTS[:1], GREEDY)) == reference[:1]
        assert not producer.has_unfinished_requests()
        assert producer.kv_cache.num_free_blocks == producer.num_kv_blocks
    finally:
        producer.close()


def test_a_producer_port_in_use_fails_at_start_up_naming_the_option(llama_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}.*"
                                             "kv_connector_extra_config.port"):
            LLMEngine(EngineConfig(model=llama_path, **ENGINE, kv_transfer_config=kv_config(
                "torch_distributed", "producer", port=port, backend="gloo")))


def test_data_parallel_replicas_cannot_share_a_point_to_point_connector(llama_path, tmp_path):
    config = EngineConfig(model=llama_path, **ENGINE, kv_transfer_config=kv_config(
        "torch_distributed", "consumer", port=free_port(), backend="gloo"))
    with pytest.raises(ValueError, match="data_parallel_size=2 replicas cannot share it"):
        DataParallelEngine(config, 2, "tiny")
    shared = EngineConfig(model=llama_path, **ENGINE, kv_transfer_config=kv_config(
        "shared_memory", "consumer", path=str(tmp_path)))
    client._check_kv_connector_replicas(shared, 2)  # files: any replica can read them
