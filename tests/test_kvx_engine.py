"""Disaggregated prefill/decode between two engines in this process: a producer computes
prompts and ships their KV through a connector, a consumer loads it and decodes. Checked
against one ordinary engine (greedy tokens), through the engines' counters (prompt tokens
computed, blocks free) and the connectors' transport (files left behind)."""

from __future__ import annotations

import logging
import os
import time

import pytest

from hitchllm.config import EngineConfig, EngineConfigError
from hitchllm.engine.llm_engine import LLMEngine
from hitchllm.entrypoints import cli
from hitchllm.request import RequestStatus
from hitchllm.sampling_params import SamplingParams

ENGINE = dict(num_kv_blocks=48, block_size=4, max_model_len=96)
PROMPTS = [list(range(3, 14)), list(range(40, 57)), [7, 8, 9], list(range(100, 130))]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PREFILL = SamplingParams(max_tokens=1, temperature=0)


def kv_config(connector: str, role: str, **extra) -> dict:
    options = {k: v for k, v in extra.items() if k != "kv_load_timeout_s"}
    config = {"kv_connector": connector, "kv_role": role, "kv_connector_extra_config": options}
    if "kv_load_timeout_s" in extra:
        config["kv_load_timeout_s"] = extra["kv_load_timeout_s"]
    return config


def run(engine: LLMEngine, prompts, params, kv_params=None, timeout_s: float = 60.0):
    """Finished outputs of ``prompts`` in order (each with its ``kv_transfer_params``)."""
    ids = [engine.add_request({"prompt_token_ids": p}, params,
                              kv_transfer_params=None if kv_params is None else kv_params[i])
           for i, p in enumerate(prompts)]
    done = {}
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not finish in time"
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[i] for i in ids]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference(llama_path):
    engine = LLMEngine(EngineConfig(model=llama_path, **ENGINE))
    yield tokens(run(engine, PROMPTS, GREEDY))
    engine.close()


@pytest.fixture
def shm_pair(llama_path, tmp_path):
    path = str(tmp_path / "kv")
    producer = LLMEngine(EngineConfig(model=llama_path, **ENGINE, kv_transfer_config=kv_config(
        "shared_memory", "producer", path=path)))
    consumer = LLMEngine(EngineConfig(model=llama_path, **ENGINE, kv_transfer_config=kv_config(
        "shared_memory", "consumer", kv_load_timeout_s=20)))
    yield producer, consumer, path
    producer.close()
    consumer.close()


def prefill(producer: LLMEngine, prompts=PROMPTS) -> list[dict]:
    outs = run(producer, prompts, PREFILL, [{"do_remote_decode": True}] * len(prompts))
    return [o.kv_transfer_params for o in outs]


def test_consumer_decodes_from_the_producers_kv_as_one_engine_would_without_computing_it(
    shm_pair, reference
):
    producer, consumer, path = shm_pair
    params = prefill(producer)
    assert all(p is not None and p["num_tokens"] == len(prompt) - 1
               for p, prompt in zip(params, PROMPTS))
    assert producer.stats().num_prompt_tokens_computed == sum(map(len, PROMPTS))
    # The producer stepped until every save was out.
    assert producer.stats().kv_transfer.num_saves == len(PROMPTS)
    assert sorted(os.listdir(path)) == sorted(
        f"{p['remote_engine_id']}.{p['remote_request_id']}.0.pt" for p in params)
    got = run(consumer, PROMPTS, GREEDY, params)
    assert tokens(got) == reference
    stats = consumer.stats()
    # Only the last prompt token of each request is computed here (its logits give the first
    # output token); the rest of every prompt came from the producer.
    assert stats.num_prompt_tokens_computed == len(PROMPTS)
    assert stats.kv_transfer.num_loads == len(PROMPTS)
    assert stats.kv_transfer.bytes_loaded > 0 and stats.kv_load_fallbacks == 0
    # Nothing leaks: every block is free again on both sides, every file was taken.
    assert consumer.kv_cache.num_free_blocks == consumer.num_kv_blocks
    assert producer.kv_cache.num_free_blocks == producer.num_kv_blocks
    assert os.listdir(path) == []


def test_requests_without_transfer_params_run_normally_on_both_roles(shm_pair, reference):
    producer, consumer, path = shm_pair
    for engine in (producer, consumer):
        outs = run(engine, PROMPTS, GREEDY)
        assert tokens(outs) == reference
        assert all(o.kv_transfer_params is None for o in outs)
    assert os.listdir(path) == []


def test_consumer_without_the_kv_falls_back_to_computing_the_prompt_after_the_timeout(
    llama_path, tmp_path, reference, caplog
):
    producer = LLMEngine(EngineConfig(model=llama_path, **ENGINE, kv_transfer_config=kv_config(
        "shared_memory", "producer", path=str(tmp_path))))
    consumer = LLMEngine(EngineConfig(model=llama_path, **ENGINE, kv_transfer_config=kv_config(
        "shared_memory", "consumer", kv_load_timeout_s=0.5)))
    params = prefill(producer, PROMPTS[:2])
    producer.close()  # the producer dies: its saved KV goes with it
    caplog.set_level(logging.WARNING, logger="hitchllm.kv_transfer.scheduling")
    start = time.monotonic()
    got = run(consumer, PROMPTS[:2], GREEDY, params)
    assert tokens(got) == reference[:2]
    assert time.monotonic() - start >= 0.5
    stats = consumer.stats()
    assert stats.kv_load_fallbacks == 2
    assert stats.num_prompt_tokens_computed == len(PROMPTS[0]) + len(PROMPTS[1])
    assert sum("computing its prompt here instead" in r.message for r in caplog.records) == 2
    assert consumer.kv_cache.num_free_blocks == consumer.num_kv_blocks
    consumer.close()


def test_a_broken_transfer_falls_back_at_once(shm_pair, reference, caplog):
    producer, consumer, path = shm_pair
    [params] = prefill(producer, PROMPTS[:1])
    [file] = os.listdir(path)
    with open(os.path.join(path, file), "wb") as f:
        f.write(b"not a KV file")
    caplog.set_level(logging.WARNING, logger="hitchllm.kv_transfer.scheduling")
    start = time.monotonic()
    got = run(consumer, PROMPTS[:1], GREEDY, [params])
    assert time.monotonic() - start < 10  # well before the 20 s timeout
    assert tokens(got) == reference[:1]
    assert consumer.stats().kv_load_fallbacks == 1
    assert consumer.stats().kv_transfer.num_failed_loads == 1
    assert any("the transfer failed" in r.message for r in caplog.records)


def test_params_made_for_another_prompt_are_not_used(shm_pair, reference, caplog):
    producer, consumer, _ = shm_pair
    params = prefill(producer, PROMPTS[:2])
    caplog.set_level(logging.WARNING, logger="hitchllm.kv_transfer.params")
    got = run(consumer, PROMPTS[:2], GREEDY, params[::-1])
    assert tokens(got) == reference[:2]
    assert consumer.stats().num_prompt_tokens_computed == len(PROMPTS[0]) + len(PROMPTS[1])
    assert sum("made for another prompt" in r.message for r in caplog.records) == 2


def test_aborting_a_request_that_waits_for_its_kv_frees_its_reserved_blocks(shm_pair):
    producer, consumer, _ = shm_pair
    [params] = prefill(producer, PROMPTS[3:])
    missing = {**params, "remote_request_id": "never-saved"}
    rid = consumer.add_request({"prompt_token_ids": PROMPTS[3]}, GREEDY,
                               kv_transfer_params=missing)
    for _ in range(3):
        assert consumer.step() == []
    request = consumer.scheduler.requests[rid]
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV
    reserved = -(-len(PROMPTS[3]) // ENGINE["block_size"])  # its last token's slot too
    assert consumer.kv_cache.num_free_blocks == consumer.num_kv_blocks - reserved
    [out] = consumer.abort_request(rid)
    assert out.outputs[0].finish_reason == "abort"
    assert consumer.kv_cache.num_free_blocks == consumer.num_kv_blocks
    consumer.step()  # the runner drops the load
    assert not consumer.has_unfinished_requests()


def test_aborting_a_request_whose_kv_arrived_before_it_ran_frees_its_blocks(shm_pair,
                                                                            reference):
    producer, consumer, _ = shm_pair
    params = prefill(producer, PROMPTS[:2])
    rid = consumer.add_request({"prompt_token_ids": PROMPTS[0]}, GREEDY,
                               kv_transfer_params=params[0])
    request = consumer.scheduler.requests[rid]
    deadline = time.monotonic() + 10
    while not consumer.scheduler.kv_transfer.is_loaded(request):
        assert time.monotonic() < deadline, "the KV did not arrive"
        assert consumer.step() == []
    # Its KV is here, waiting to be copied into its blocks by the step that runs it.
    assert request.status is RequestStatus.WAITING and request.num_computed_tokens > 0
    consumer.abort_request(rid)
    assert consumer.kv_cache.num_free_blocks == consumer.num_kv_blocks
    # The engine goes on: the next request decodes from its KV as before.
    got = run(consumer, PROMPTS[1:2], GREEDY, params[1:])
    assert tokens(got) == reference[1:2]
    assert consumer.kv_cache.num_free_blocks == consumer.num_kv_blocks


def test_kv_transfer_params_are_refused_where_they_cannot_work(llama_path, shm_pair):
    producer, consumer, _ = shm_pair
    plain = LLMEngine(EngineConfig(model=llama_path, **ENGINE))
    with pytest.raises(ValueError, match="kv_transfer_config"):
        plain.add_request("hi", PREFILL, kv_transfer_params={"do_remote_decode": True})
    with pytest.raises(ValueError, match="n=1 only"):
        producer.add_request("hi", SamplingParams(n=2), kv_transfer_params={
            "do_remote_decode": True})
    with pytest.raises(ValueError, match="lacks kv_connector"):
        consumer.add_request("hi", PREFILL, kv_transfer_params={"do_remote_decode": True})
    plain.close()


def test_bad_kv_transfer_config_fails_at_start_up_saying_what_to_change(llama_path):
    with pytest.raises(ValueError, match="'nixl' is not provided.*installed: .*shared_memory"):
        LLMEngine(EngineConfig(model=llama_path, **ENGINE,
                               kv_transfer_config=kv_config("nixl", "producer")))
    with pytest.raises(EngineConfigError, match="kv_role"):
        EngineConfig(model=llama_path, kv_transfer_config={"kv_connector": "shared_memory",
                                                           "kv_role": "prefill"})
    with pytest.raises(ValueError, match="has no option 'dir'.*path, ttl_s"):
        LLMEngine(EngineConfig(model=llama_path, **ENGINE, kv_transfer_config=kv_config(
            "shared_memory", "producer", dir="/tmp")))
    with pytest.raises(ValueError, match="backend must be nccl or gloo"):
        LLMEngine(EngineConfig(model=llama_path, **ENGINE, kv_transfer_config=kv_config(
            "torch_distributed", "consumer", backend="mpi")))
    with pytest.raises(ValueError, match="cannot be combined with pipeline stages"):
        LLMEngine(EngineConfig(model=llama_path, **ENGINE, pipeline_parallel_size=2,
                               kv_transfer_config=kv_config("shared_memory", "producer")))
    with pytest.raises(ValueError, match="cannot run speculative decoding"):
        LLMEngine(EngineConfig(model=llama_path, **ENGINE, speculative_method="ngram",
                               num_speculative_tokens=2,
                               kv_transfer_config=kv_config("shared_memory", "consumer")))
    parser = cli.build_parser()
    with pytest.raises(ValueError, match="both --kv-role .* and --kv-connector"):
        cli.engine_kwargs(parser.parse_args(["serve", "--kv-role", "producer"]))
    with pytest.raises(ValueError, match="--kv-connector-extra-config is not JSON"):
        cli.engine_kwargs(parser.parse_args(["serve", "--kv-role", "producer", "--kv-connector",
                                             "shared_memory", "--kv-connector-extra-config",
                                             "{path: x}"]))
    args = parser.parse_args(["serve", "--kv-role", "consumer", "--kv-connector",
                              "torch_distributed", "--kv-connector-extra-config",
                              '{"port": 1234}', "--kv-load-timeout-s", "5"])
    assert cli.engine_kwargs(args)["kv_transfer_config"] == {
        "kv_role": "consumer", "kv_connector": "torch_distributed",
        "kv_connector_extra_config": {"port": 1234}, "kv_load_timeout_s": 5.0}


def test_torch_distributed_connector_moves_the_kv_over_a_gloo_pair(llama_path, reference):
    from server_process import free_port

    port = free_port()
    producer = LLMEngine(EngineConfig(model=llama_path, **ENGINE, kv_transfer_config=kv_config(
        "torch_distributed", "producer", port=port, backend="gloo")))
    consumer = LLMEngine(EngineConfig(model=llama_path, **ENGINE, kv_transfer_config=kv_config(
        "torch_distributed", "consumer", port=port, backend="gloo", kv_load_timeout_s=30)))
    try:
        params = prefill(producer)
        got = run(consumer, PROMPTS, GREEDY, params)
        assert tokens(got) == reference
        assert consumer.stats().num_prompt_tokens_computed == len(PROMPTS)
        assert consumer.stats().kv_transfer.num_loads == len(PROMPTS)
        assert consumer.kv_cache.num_free_blocks == consumer.num_kv_blocks
        assert producer.kv_cache.num_free_blocks == producer.num_kv_blocks
    finally:
        producer.close()
        consumer.close()


def test_under_tensor_parallelism_each_rank_moves_its_own_shard(llama_path, tmp_path,
                                                                 reference):
    path = str(tmp_path / "kv")
    producer = LLMEngine(EngineConfig(model=llama_path, **ENGINE, tensor_parallel_size=2,
                                      kv_transfer_config=kv_config("shared_memory", "producer",
                                                                   path=path)))
    consumer = LLMEngine(EngineConfig(model=llama_path, **ENGINE, tensor_parallel_size=2,
                                      kv_transfer_config=kv_config("shared_memory", "consumer")))
    try:
        params = prefill(producer, PROMPTS[:2])
        # One file per request and rank: each rank saved its own KV heads (the engine waits
        # for rank 0's saves; rank 1 writes in its own time).
        deadline = time.monotonic() + 10
        while (len([f for f in os.listdir(path) if f.endswith(".pt")]) < 4
               and time.monotonic() < deadline):
            time.sleep(0.05)
        assert sorted(os.listdir(path)) == sorted(
            f"{p['remote_engine_id']}.{p['remote_request_id']}.{rank}.pt"
            for p in params for rank in (0, 1))
        got = run(consumer, PROMPTS[:2], GREEDY, params)
        assert tokens(got) == reference[:2]
        assert consumer.stats().num_prompt_tokens_computed == 2
        assert os.listdir(path) == []
    finally:
        producer.close()
        consumer.close()
