"""The step plan is plain data: it survives pickle (as it must to reach a worker process),
the model runner works from it alone, and an engine whose every plan and output cross pickle
generates exactly what the in-process engine does."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from reference import hf_greedy
from test_import_graph import top_level_imports
from test_models_hf_parity import greedy, mixed_prompts
from test_speculative import proposers  # noqa: F401 (fixture)

import hitchllm
from hitchllm import LLM, SamplingParams
from hitchllm.engine.executor import Executor
from hitchllm.scheduler.step_plan import NewRequestData, StepPlan


def test_a_step_plan_round_trips_through_pickle():
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=3, stop=["\n"], logprobs=2,
                            structured_outputs={"regex": "[a-z]+"})
    plan = StepPlan(
        request_ids=["a", "b"], num_scheduled_tokens=[17, 3], num_computed_tokens=[0, 40],
        samples=[True, True], new_block_ids=[[4, 9, 2], []],
        new_requests=[NewRequestData("a", list(range(17)), params, (2, 7), [5])],
        draft_token_ids={"b": [11, 12]}, draft_probs={"b": torch.rand(2, 32)},
        preempted_ids=["c"], finished_ids=["d"])
    back = pickle.loads(pickle.dumps(plan))
    assert back.draft_probs["b"].equal(plan.draft_probs["b"])
    back.draft_probs = plan.draft_probs = {}
    assert back == plan
    assert back.new_requests[0].sampling_params == params


def test_the_runner_imports_nothing_of_the_scheduler_side():
    """The runner's modules (and everything they import) never load ``hitchllm.request`` or
    the scheduler: a worker process needs the plan's data types and nothing else."""
    root = Path(hitchllm.__file__).parent
    modules = {".".join(("hitchllm", *p.relative_to(root).with_suffix("").parts))
               .removesuffix(".__init__"): p for p in root.rglob("*.py")}
    seen, todo = set(), ["hitchllm.engine.executor"]
    while todo:
        name = todo.pop()
        if name in seen or name not in modules:
            continue
        seen.add(name)
        todo += top_level_imports(modules[name], name)
    assert "hitchllm.engine.model_runner" in seen
    assert not {"hitchllm.request", "hitchllm.scheduler.scheduler",
                "hitchllm.engine.llm_engine"} & seen


def test_the_runner_generates_from_hand_written_plans(llama_path):
    """Plans written by hand (no scheduler, blocks picked arbitrarily) drive the runner to
    the tokens transformers generates: the plan is all the runner needs."""
    runner = LLM(llama_path, block_size=4, num_kv_blocks=64, dtype="float32").engine.executor.runner
    prompts = mixed_prompts(3, lengths=(6, 13))
    blocks = {"x": [63, 5, 17, 40, 2, 33, 8, 51], "y": [1, 60, 22, 9, 48, 30, 14, 3]}
    new = [NewRequestData(rid, p, greedy()) for rid, p in zip(blocks, prompts)]
    # Step 1: both prompts (one in two chunks); then one token per request and step.
    steps = [StepPlan(["x", "y"], [6, 8], [0, 0], [True, False], [blocks["x"][:2],
                                                                  blocks["y"][:2]], new),
             StepPlan(["x", "y"], [1, 5], [6, 8], [True, True], [[], blocks["y"][2:4]])]
    out = {rid: [] for rid in blocks}
    for plan in steps:
        for rid, tokens in runner.execute(plan).sampled.items():
            out[rid] += tokens
    pos = {"x": 7, "y": 13}  # the position each request computes next
    while len(out["x"]) < 16 or len(out["y"]) < 16:
        ids = [rid for rid in blocks if len(out[rid]) < 16]
        grow = [[blocks[rid][pos[rid] // 4]] if pos[rid] % 4 == 0 else [] for rid in ids]
        plan = StepPlan(ids, [1] * len(ids), [pos[rid] for rid in ids], [True] * len(ids), grow)
        for rid, tokens in runner.execute(plan).sampled.items():
            out[rid] += tokens
            pos[rid] += 1
    assert [out["x"], out["y"]] == hf_greedy(llama_path, prompts, 16)


class PicklingExecutor(Executor):
    """Sends every plan, and every output back, through pickle, as a worker process would;
    checks each plan against the engine's state when it is executed."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.inner = engine.executor
        self.plans: list[StepPlan] = []
        self.blocks: dict[str, list[int]] = {}  # the runner's view, rebuilt from the plans
        # What ``_check`` found (raised inside a step, it would only fail that step's requests).
        self.errors: list[str] = []

    @property
    def kv_cache_specs(self):
        return self.inner.kv_cache_specs

    def kv_cache_bytes(self, gpu_memory_utilization: float) -> int:
        return self.inner.kv_cache_bytes(gpu_memory_utilization)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.inner.initialize_kv_cache(num_blocks)

    def warm_up(self) -> None:
        self.inner.warm_up()

    def capture_cuda_graphs(self) -> None:
        self.inner.capture_cuda_graphs()

    def execute_model(self, step):
        try:
            self._check(step)
        except AssertionError as exc:
            self.errors.append(repr(exc))
        self.plans.append(step)
        future = self.inner.execute_model(pickle.loads(pickle.dumps(step)))
        return _PickledFuture(future)

    def _check(self, plan: StepPlan) -> None:
        # (A request may finish between its step's scheduling and launch, when the step
        # before completes: it is then gone from the scheduler.)
        live = self.engine.scheduler.requests
        for rid in plan.preempted_ids + plan.finished_ids:
            self.blocks.pop(rid, None)
        for new in plan.new_requests:
            assert new.request_id not in self.blocks, "told twice of a request"
            if new.request_id in live:
                assert new.output_token_ids == live[new.request_id].output_token_ids
            self.blocks[new.request_id] = []
        for rid, new_blocks in zip(plan.request_ids, plan.new_block_ids, strict=True):
            self.blocks[rid] += new_blocks
            if rid in live:
                assert self.blocks[rid] == self.engine.kv_cache.get_block_ids(rid)


class _PickledFuture:
    def __init__(self, future) -> None:
        self.future = future

    def result(self):
        out = self.future.result()
        out.hidden_states = None  # stays on the device; not part of what a worker sends
        return pickle.loads(pickle.dumps(out))


def _generate(llm: LLM, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.prompt_logprobs, [(c.token_ids, c.text, c.finish_reason, c.logprobs)
                                 for c in o.outputs]) for o in outs]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_engine_whose_plans_cross_pickle_generates_the_same(llama_path, async_scheduling):
    """Preemption (a small KV cache), chunked prefill, n > 1, seeds, penalties, logprobs,
    prompt logprobs and stop strings, with every plan pickled on its way to the runner."""
    kwargs = dict(block_size=4, num_kv_blocks=20, max_model_len=64, max_num_batched_tokens=24,
                  async_scheduling=async_scheduling)
    plain = LLM(llama_path, **kwargs)
    pickled = LLM(llama_path, **kwargs)
    executor = PicklingExecutor(pickled.engine)
    pickled.engine.executor = executor
    prompts = mixed_prompts(5, lengths=(3, 17, 30, 9, 21, 12))
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=30, seed=4, max_tokens=20, logprobs=2),
        SamplingParams(temperature=0.8, seed=9, n=2, max_tokens=16, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=1),
        SamplingParams(temperature=0, max_tokens=24, stop=["e"]),
        SamplingParams(temperature=0.9, seed=1, max_tokens=24, min_tokens=24, top_p=0.8),
    ]
    assert _generate(pickled, prompts, params) == _generate(plain, prompts, params)
    assert not executor.errors
    plans = executor.plans
    assert pickled.engine.stats().num_preemptions > 0
    assert any(new.output_token_ids for p in plans for new in p.new_requests)  # resumed
    assert any(not s for p in plans for s in p.samples)  # a prompt chunk mid-way
    assert pickled.engine.kv_cache.usage == 0.0


def test_drafts_and_their_probs_cross_pickle(tiny_models, proposers):  # noqa: F811
    path = tiny_models["LlamaForCausalLM"]
    prompts = mixed_prompts(5, lengths=(3, 17, 30, 9))
    kwargs = dict(block_size=4, dtype="float32", speculative_method="sampled",
                  num_speculative_tokens=3)
    plain = LLM(path, **kwargs)
    pickled = LLM(path, **kwargs)
    executor = PicklingExecutor(pickled.engine)
    pickled.engine.executor = executor
    params = [greedy(), SamplingParams(temperature=1.0, top_k=20, max_tokens=16, seed=3)]
    params = [params[i % 2] for i in range(len(prompts))]
    # (Both engines' proposers draw their drafts from generators seeded alike.)
    assert _generate(pickled, prompts, params) == _generate(plain, prompts, params)
    assert not executor.errors
    assert any(p.draft_probs for p in executor.plans)
