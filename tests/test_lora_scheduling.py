"""Scheduling with adapters: at most max_loras adapters run at once and the others' requests
wait (never fail) yet come out right; the host cache evicts beyond max_cpu_loras and reads
adapters again; prefix-cache blocks are never shared across adapters; no KV block leaks.
Also the core's admission-gate seam on its own."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from hitchllm_lora import manager_for
from hitchllm_lora.adapter import LoRAAdapter
from hitchllm_lora.gate import AdapterGate
from hitchllm_lora.slots import AdapterSlots
from lora_reference import peft_greedy, peft_model, write_adapter
from test_models_hf_parity import mixed_prompts

from hitchllm import LLM, LoRARequest, SamplingParams
from hitchllm.kv_cache.manager import KVCacheManager
from hitchllm.request import Request, RequestStatus
from hitchllm.scheduler.admission import AdmissionGate
from hitchllm.scheduler.scheduler import Scheduler, SchedulerConfig

MAX_NEW = 6


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory):
    base = tiny_models["LlamaForCausalLM"]
    root = tmp_path_factory.mktemp("sched-adapters")
    targets = [["q_proj", "v_proj"], ["gate_proj", "down_proj"], ["o_proj", "up_proj"]]
    paths = {f"ad{i}": write_adapter(base, root / f"ad{i}", 4, t, seed=10 + i)
             for i, t in enumerate(targets)}
    return base, paths


def greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)


def test_more_adapters_than_slots_wait_and_finish_correctly(adapters, caplog):
    base, paths = adapters
    llm = LLM(base, enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=4)
    engine = llm.engine
    names = ["ad0", "ad1", None, "ad2", "ad0", "ad1", None, "ad2"]
    prompts = mixed_prompts(5, lengths=(4, 9, 6, 13, 2, 7, 5, 10))
    ids = {}
    for i, (name, prompt) in enumerate(zip(names, prompts)):
        lora = None if name is None else LoRARequest(name, int(name[-1]) + 1, paths[name])
        ids[engine.add_request({"prompt_token_ids": prompt}, greedy(), lora_request=lora)] = i
    tokens: dict[int, list[int]] = {}
    waited_for_a_slot = False
    with caplog.at_level(logging.INFO, logger="hitchllm.lora"):
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens[ids[out.request_id]] = out.outputs[0].token_ids
            running = {r.lora_name for r in engine.scheduler.running} - {None}
            assert len(running) <= 1
            waited_for_a_slot |= any(r.lora_name not in running | {None}
                                     for r in engine.scheduler.waiting)
    assert waited_for_a_slot  # the test did make requests wait for the one slot
    assert len(tokens) == len(names)  # every request finished, none failed
    oracles = {n: peft_model(base, paths.get(n)) for n in set(names)}
    for i, (name, prompt) in enumerate(zip(names, prompts)):
        assert tokens[i] == peft_greedy(oracles[name], prompt, MAX_NEW), (i, name)
    manager = manager_for(engine.config)
    assert manager.slots.num_activations >= 3  # the single slot was swapped
    assert manager.cache.num_evictions >= 2  # one adapter in host memory at a time
    assert manager.cache.num_reads > 3  # evicted adapters were read again
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("loaded LoRA adapter 'ad0'") for m in messages)
    assert any(m.startswith("evicted LoRA adapter") for m in messages)
    assert engine.kv_cache.usage == 0
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_prefix_cache_blocks_are_never_shared_across_adapters(adapters):
    base, paths = adapters
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=4, block_size=4)
    prompt = {"prompt_token_ids": mixed_prompts(3, lengths=(20,))[0]}

    def cached(lora: LoRARequest | None) -> int:
        out = llm.generate(prompt, greedy(2), lora_request=lora, use_tqdm=False)[0]
        return out.num_cached_tokens

    a, b = LoRARequest("ad0", 1, paths["ad0"]), LoRARequest("ad1", 2, paths["ad1"])
    assert cached(a) == 0
    assert cached(a) == 16  # the same adapter reuses its blocks
    assert cached(b) == 0  # another adapter does not
    assert cached(None) == 0  # nor does the base model
    assert cached(LoRARequest("ad0", 1)) == 16  # named without a path: the same adapter
    # The same name bound to another directory is another adapter.
    manager_for(llm.engine.config).remove_adapter("ad0")
    assert cached(LoRARequest("ad0", 1, paths["ad2"])) == 0
    assert llm.engine.kv_cache.usage == 0


def test_adapter_gate_counts_running_adapters():
    gate = AdapterGate(max_loras=2)

    def request(rid: str, name: str | None) -> Request:
        lora = None if name is None else LoRARequest(name, 1, f"/adapters/{name}")
        return Request(rid, [1, 2], SamplingParams(), lora_request=lora)

    a1, a2, b, c, base = (request("1", "a"), request("2", "a"), request("3", "b"),
                          request("4", "c"), request("5", None))
    for r in (a1, b):
        assert gate.may_admit(r)
        gate.admitted(r)
    assert not gate.may_admit(c)  # both slots serve running adapters
    assert gate.may_admit(a2) and gate.may_admit(base)
    gate.admitted(a2)
    gate.released(a1)
    assert not gate.may_admit(c)  # a2 still runs adapter a
    gate.released(a2)
    assert gate.may_admit(c)


class RecordingGate(AdmissionGate):
    """Refuses the request ids in ``held``; records what the scheduler tells it."""

    def __init__(self) -> None:
        self.held: set[str] = set()
        self.events: list[tuple[str, str]] = []

    def may_admit(self, request: Request) -> bool:
        return request.request_id not in self.held

    def admitted(self, request: Request) -> None:
        self.events.append(("admitted", request.request_id))

    def released(self, request: Request) -> None:
        self.events.append(("released", request.request_id))


def test_scheduler_keeps_a_gated_request_waiting_and_admits_those_behind_it():
    gate = RecordingGate()
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64),
        KVCacheManager(64, 4), gates=[gate])
    requests = [Request(rid, [1, 2, 3], SamplingParams(max_tokens=4)) for rid in "abc"]
    for r in requests:
        scheduler.add_request(r)
    gate.held = {"a"}
    plan = scheduler.schedule()
    assert plan.request_ids == ["b", "c"]
    assert [r.request_id for r in scheduler.waiting] == ["a"]  # kept its place
    assert gate.events == [("admitted", "b"), ("admitted", "c")]
    gate.held = set()
    assert scheduler.schedule().request_ids[-1] == "a"
    scheduler.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    scheduler.quarantine([requests[2]])  # preempts c
    assert gate.events[2:] == [("admitted", "a"), ("released", "b"), ("released", "c")]
    scheduler.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)  # waiting: not running
    assert gate.events[-1] == ("released", "c")


class FakeCache:
    """Hands out empty adapters and counts the reads."""

    def __init__(self) -> None:
        self.reads: list[str] = []

    def get(self, request: LoRARequest) -> LoRAAdapter:
        self.reads.append(request.lora_name)
        return LoRAAdapter(request, rank=1, scaling=float(request.lora_int_id), weights={})


def row(name: str | None) -> SimpleNamespace:
    """A runner-side request state as the hook sees it."""
    return SimpleNamespace(lora_request=None if name is None else LoRARequest(
        name, ord(name), f"/adapters/{name}"))


def test_a_slot_is_never_taken_from_a_running_request_not_scheduled_this_step():
    cache = FakeCache()
    slots = AdapterSlots(2, 16, torch.device("cpu"), cache)  # type: ignore[arg-type]
    x, y, z, base = row("x"), row("y"), row("z"), row(None)
    slots.prepare([x, y], [3, 2], running=[x, y])
    assert slots.token_slot[:6].tolist() == [0, 0, 0, 1, 1, -1]
    slots.prepare([y], [1], running=[x, y])  # x runs but is not scheduled: least recent
    slots.prepare([z, base], [1, 1], running=[x, z, base])  # y finished: its slot goes
    assert slots.keys[0] == ("x", "/adapters/x", 0) and slots.keys[1] == ("z", "/adapters/z", 0)
    assert slots.token_slot.tolist() == [1, -1] + [-1] * 14  # the longer last step: cleared
    assert slots.scaling.tolist() == [float(ord("x")), float(ord("z"))]
    assert cache.reads == ["x", "y", "z"]
    with pytest.raises(RuntimeError, match="admission gate"):
        slots.prepare([y], [1], running=[x, z, y])


def test_preempted_requests_give_up_their_adapter_and_resume_correctly(adapters):
    """A KV cache too small for every request at once preempts (and recomputes) some of
    them; each preemption releases its adapter in the gate, and every request still comes
    out as PEFT's."""
    base, paths = adapters
    names = ["ad0", "ad1", "ad2", "ad0", None, "ad1"]
    prompts = mixed_prompts(9, lengths=(14, 11, 13, 9, 12, 10))
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=4, block_size=4,
              num_kv_blocks=12, enable_prefix_caching=False)
    n = 12
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(n), use_tqdm=False,
                        lora_request=[None if m is None else LoRARequest(m, 1, paths[m])
                                      for m in names])
    assert llm.engine.stats().num_preemptions > 0
    assert not manager_for(llm.engine.config).gate.running  # every admission released
    oracles = {m: peft_model(base, paths.get(m)) for m in set(names)}
    for name, prompt, out in zip(names, prompts, outs):
        assert out.outputs[0].token_ids == peft_greedy(oracles[name], prompt, n), name
    assert llm.engine.kv_cache.usage == 0
