"""A pipeline stage's forward as its CUDA graphs run it (``graph_transfers``: the stage reads
the previous stage's activations from its ``StageGraphIO`` input and leaves its own in the
outputs, and the runner moves them between stages around each replay) computes what the
whole model computes in one process. Checked on the CPU without graphs: two stage runners of
the bundled Llama, in this process, whose activations are handed over through their graph I/O
buffers, sample the greedy tokens of the one-process runner for a prefill and decode steps."""

from __future__ import annotations

import pytest
import torch
from tp_support import only_builtin_plugins  # noqa: F401

from hitchllm import LLM, SamplingParams, distributed
from hitchllm.config import ModelConfig
from hitchllm.distributed import ParallelRank
from hitchllm.engine.model_runner import ModelRunner
from hitchllm.models.loader import load_model
from hitchllm.models.pipeline import StageGraphIO, graph_transfers, model_stage
from hitchllm.plugins import get_plugin_registry
from hitchllm.scheduler.step_plan import NewRequestData, StepPlan

pytestmark = pytest.mark.usefixtures("only_builtin_plugins")

PROMPTS = {"a": [5, 9, 13, 200, 7, 7, 31], "b": [400, 3, 88, 12, 19]}
BLOCK = 16


def stage_runner(path: str, like: ModelRunner, rank: ParallelRank) -> ModelRunner:
    """A runner of stage ``rank`` of the checkpoint, set up as ``like``."""
    with distributed.pretend_rank(rank):
        model = load_model(ModelConfig.from_pretrained(path), get_plugin_registry(),
                           torch.device("cpu"), torch.float32)
        runner = ModelRunner(model, like.backend, like.spec, like.max_num_seqs,
                             like.max_num_tokens, like.max_model_len, like.vocab_size,
                             torch.device("cpu"), seed=0, samples=rank.is_last_stage)
    runner.initialize_kv_cache(8)
    return runner


def plans(num_decodes: int) -> list[StepPlan]:
    """A prefill of both prompts (two blocks each), then decode steps."""
    ids = list(PROMPTS)
    greedy = SamplingParams(temperature=0, max_tokens=num_decodes + 1, ignore_eos=True)
    prefill = StepPlan(ids, [len(PROMPTS[r]) for r in ids], [0, 0], [True, True],
                       [[0, 1], [2, 3]],
                       [NewRequestData(r, PROMPTS[r], greedy) for r in ids])
    return [prefill] + [StepPlan(ids, [1, 1], [len(PROMPTS[r]) + k for r in ids], [True, True],
                                 [[], []]) for k in range(num_decodes)]


def test_stages_through_graph_io_buffers_sample_what_one_runner_samples(llama_path):
    with LLM(llama_path, device="cpu", dtype="float32", block_size=BLOCK, num_kv_blocks=8,
             async_scheduling=False) as llm:
        whole = llm.engine.executor.runner
        first = stage_runner(llama_path, whole, ParallelRank(pp_rank=0, pp_size=2))
        last = stage_runner(llama_path, whole, ParallelRank(pp_rank=1, pp_size=2))
        stage = model_stage(first.model)
        assert stage is not None and stage.is_first and model_stage(last.model).is_last
        io_first = StageGraphIO(64, stage.hidden_size, torch.float32, torch.device("cpu"))
        io_last = StageGraphIO(64, stage.hidden_size, torch.float32, torch.device("cpu"))
        for step, plan in enumerate(plans(num_decodes=6)):
            expected = whole.execute(plan).sampled
            with graph_transfers(io_first):
                assert not first.execute(plan).sampled  # no head: it hands its output on
            tokens = sum(plan.num_scheduled_tokens)
            handed = io_first.outputs.pop(tokens)
            assert handed.shape == (2, tokens, stage.hidden_size)
            io_last.input(tokens).copy_(handed)
            with graph_transfers(io_last):
                got = last.execute(plan).sampled
            assert got == expected, f"step {step}"
            first.append_fed_tokens(got)  # what the driver feeds the earlier stages


def test_outside_graph_transfers_a_stage_needs_its_process_group(llama_path):
    with distributed.pretend_rank(ParallelRank(pp_rank=1, pp_size=2)):
        model = load_model(ModelConfig.from_pretrained(llama_path), get_plugin_registry(),
                           torch.device("cpu"), torch.float32)
        stage = model_stage(model)
        with pytest.raises(RuntimeError, match="only inside a process group"):
            stage.receive(3, torch.device("cpu"))
        io = StageGraphIO(8, stage.hidden_size, torch.float32, torch.device("cpu"))
        io.input(3).copy_(torch.arange(2 * 3 * stage.hidden_size, dtype=torch.float32)
                          .view(2, 3, -1))
        with graph_transfers(io):
            hidden, residual = stage.receive(3, torch.device("cpu"))
        assert torch.equal(hidden, io.input(3)[0]) and torch.equal(residual, io.input(3)[1])
        assert hidden.is_contiguous() and io.input(3).data_ptr() == io.input(5).data_ptr()
