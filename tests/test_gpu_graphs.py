"""CUDA graphs and memory-profiled KV sizing (run on the GPU machine; skipped elsewhere)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest
import torch
from reference import hf_greedy
from test_models_hf_parity import mixed_prompts

from hitchllm import LLM, SamplingParams
from hitchllm.models import fused
from hitchllm.tiny_model import build_tiny_checkpoint

pytestmark = pytest.mark.gpu

# Output lengths that make the batch shrink through several capture sizes (8, 4, 2, 1).
MAX_TOKENS = (40, 3, 17, 25, 9, 33, 1, 12, 28)


def _generate(llm: LLM, prompts: list[list[int]], temperature: float) -> list[list[int]]:
    params = [SamplingParams(temperature=temperature, seed=i if temperature else None,
                             max_tokens=m, ignore_eos=True) for i, m in enumerate(MAX_TOKENS)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "LlamaForCausalLM"])
def test_cuda_graph_runs_equal_eager_runs_exactly(tiny_models, arch):
    prompts = mixed_prompts(3, lengths=(1, 3, 7, 16, 29, 45, 5, 12, 33))
    eager = LLM(tiny_models[arch], device="cuda", attention_backend="TRITON_ATTN",
                enforce_eager=True)
    graphs = LLM(tiny_models[arch], device="cuda", attention_backend="TRITON_ATTN")
    assert graphs.engine.executor.runner.graphs.captured
    assert not eager.engine.executor.runner.graphs.captured
    replays = []
    replay = graphs.engine.executor.runner.graphs.replay
    graphs.engine.executor.runner.graphs.replay = (
        lambda size, query_len=1: replays.append(size) or replay(size, query_len))
    for temperature in (0.0, 1.0):  # greedy, and seeded sampling (needs identical logits)
        assert _generate(graphs, prompts, temperature) == _generate(eager, prompts, temperature)
    assert {1, 2, 4, 8} <= set(replays)


def test_triton_bfloat16_with_graphs_tracks_transformers(tiny_models):
    path = tiny_models["Qwen3ForCausalLM"]
    prompts = mixed_prompts(4, lengths=(4, 21, 40))
    llm = LLM(path, device="cuda", attention_backend="TRITON_ATTN")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4),
                        use_tqdm=False)
    ref = hf_greedy(path, prompts, 4, dtype=torch.bfloat16)
    assert [o.outputs[0].token_ids[:2] for o in outs] == [r[:2] for r in ref]


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> str:
    """Large KV per block and a long max_model_len, so the memory budget (not the cap of
    max_num_seqs full-length requests) decides the number of blocks."""
    return str(build_tiny_checkpoint(
        tmp_path_factory.mktemp("wide") / "llama", "LlamaForCausalLM", hidden_size=1024,
        intermediate_size=256, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=16, max_position_embeddings=32768))


def test_kv_cache_takes_what_gpu_memory_utilization_leaves(wide_model):
    total = torch.cuda.get_device_properties(0).total_memory
    llm = LLM(wide_model, device="cuda", gpu_memory_utilization=0.4)
    runner = llm.engine.executor.runner
    kv_bytes = sum(c.numel() * c.element_size() for c in runner.kv_caches)
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    # Everything but weights, peak activations and non-PyTorch memory (well under 3 GiB for
    # this model) goes to the cache, and the engine stays within its share of the card.
    assert 0.4 * total - weights - 3 * 2**30 < kv_bytes < 0.4 * total - weights
    assert torch.cuda.memory_allocated() < 0.4 * total


def test_a_card_share_too_small_for_one_request_fails_at_start(wide_model):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(wide_model, device="cuda", gpu_memory_utilization=0.01)


def test_fused_elementwise_ops_match_unfused(tiny_models):
    """The fused norms, rotary and activation give the eager ops' tokens (float32)."""
    path = tiny_models["Qwen3ForCausalLM"]
    prompts = mixed_prompts(5)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def run(fusion: bool) -> list[list[int]]:
        llm = LLM(path, device="cuda", dtype="float32", enable_fusion=fusion)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    try:
        assert run(True) == run(False)
    finally:
        fused.set_fusion(True)


def test_async_scheduling_on_cuda_equals_sequential_steps(tiny_models):
    """Overlapped steps (pending tokens read on the device, host buffers refilled while the
    previous step runs) give the tokens of one-step-at-a-time runs, as rows come and go."""
    path = tiny_models["LlamaForCausalLM"]
    prompts = mixed_prompts(6, lengths=(1, 3, 7, 16, 29, 45, 5, 12, 33))
    runs = [LLM(path, device="cuda", attention_backend="TRITON_ATTN", async_scheduling=mode)
            for mode in (True, False)]
    for temperature in (0.0, 1.0):
        overlapped, sequential = (_generate(llm, prompts, temperature) for llm in runs)
        assert overlapped == sequential


def test_engine_starts_when_max_num_seqs_times_max_model_len_is_below_the_step_budget(
        tiny_models):
    """Measuring peak memory plans the largest step the scheduler can: with 2 requests of at
    most 64 tokens that is 128 tokens, not max_num_batched_tokens (8192) split into requests
    longer than max_model_len (which overflowed the block table at start-up)."""
    gc.collect()  # engines of earlier tests still hold their KV caches until collected
    torch.cuda.empty_cache()
    llm = LLM(tiny_models["LlamaForCausalLM"], device="cuda", max_num_seqs=2, max_model_len=64,
              gpu_memory_utilization=0.3)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                       SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def _backends() -> list[str]:
    import importlib.util

    return ["TRITON_ATTN"] + (["FLASHINFER"] if importlib.util.find_spec("flashinfer") else [])


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "LlamaForCausalLM"])
def test_piecewise_graphs_equal_the_same_steps_run_eagerly(tiny_models, tmp_path, arch,
                                                           backend):
    """Prompt chunks, mixed steps and a prefix-cache hit replayed as graph pieces around
    eager attention give the tokens of the same padded steps run eagerly (greedy and seeded
    sampling, so the logits must match exactly). FlashInfer serves head sizes from 64 up: it
    gets a tiny model with 64-wide heads."""
    path = tiny_models[arch] if backend == "TRITON_ATTN" else str(
        build_tiny_checkpoint(tmp_path / arch, arch, head_dim=64))
    prompts = mixed_prompts(7, lengths=(3, 57, 20, 9, 31, 120, 1, 44))
    prompts.append([*prompts[1][:40], 7, 8, 9])
    kwargs = dict(device="cuda", attention_backend=backend, max_num_batched_tokens=64,
                  enable_prefix_caching=True)
    eager = LLM(path, enforce_eager=True, **kwargs)
    graphs = LLM(path, **kwargs)
    pieces = graphs.engine.executor.runner.pieces
    assert pieces.captured and not eager.engine.executor.runner.pieces.captured
    replays = []
    replay = pieces.replay
    pieces.replay = lambda tokens, n, metadata: replays.append((tokens, n)) or replay(
        tokens, n, metadata)

    def run(llm: LLM, temperature: float) -> list[list[int]]:
        params = [SamplingParams(temperature=temperature, seed=i if temperature else None,
                                 max_tokens=5 + 3 * i, ignore_eos=True)
                  for i in range(len(prompts))]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    for temperature in (0.0, 1.0):
        assert run(graphs, temperature) == run(eager, temperature)
    assert any(n < tokens for tokens, n in replays) and any(n == 64 for _, n in replays)


def test_piecewise_graphs_keep_transformers_tokens(tiny_models):
    """Graph pieces against an independent reference: float32 greedy tokens equal Hugging
    Face transformers' on chunked prompts."""
    path = tiny_models["Qwen3ForCausalLM"]
    prompts = mixed_prompts(8, lengths=(5, 70, 33))
    llm = LLM(path, device="cuda", dtype="float32", max_num_batched_tokens=48)
    assert llm.engine.executor.runner.pieces.captured
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, 8)


# Run in a process of its own: Triton's in-memory kernels and Dynamo's graphs are per process,
# and earlier tests here have compiled what an engine needs already.
_FIRST_REQUESTS = r"""
import json, random, sys
import triton
from torch._dynamo.utils import counters
from hitchllm import LLM, SamplingParams

compiled = []

def on_compile(*args, **kwargs):
    compiled.append(str(kwargs.get("repr", ""))[:120])
    return False  # compile (or load from disk) as usual

triton.knobs.runtime.jit_cache_hook = on_compile
llm = LLM(sys.argv[1], device="cuda", attention_backend="TRITON_ATTN", max_num_batched_tokens=64,
          **json.loads(sys.argv[2]))
at_start_up, compiled = len(compiled), []
graphs = counters["stats"]["unique_graphs"]
rng = random.Random(3)
prompts = [{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(n)]}
           for n in (1, 5, 19, 37, 60, 83, 130, 211, 70)]
for temperature in (0.6, 0.0):  # unseeded: plain temperature sampling, then greedy
    params = [SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=True)
              for m in (40, 3, 17, 25, 9, 33, 1, 12, 28)]
    llm.generate(prompts, params, use_tqdm=False)
print(json.dumps({"at_start_up": at_start_up, "compiled": compiled,
                  "graphs": counters["stats"]["unique_graphs"] - graphs}))
"""


@pytest.mark.parametrize("engine_args", [{}, {"num_kv_blocks": 256}],
                         ids=["profiled", "kv-blocks-given"])
def test_requests_after_start_up_compile_nothing(tiny_models, engine_args):
    """Start-up compiles every Triton kernel variant and Dynamo graph that plain requests
    need, also when the KV cache's size is given (no profiling step): prompts chunked into
    steps of every size beside decoding requests, short last chunks, plain temperature
    sampling and greedy launch nothing new in a fresh process (a compile on a request's step
    stalls the whole batch for about a second)."""
    triton = pytest.importorskip("triton")
    if getattr(getattr(triton, "knobs", None), "runtime", None) is None:
        pytest.skip("this Triton has no JIT hooks (triton.knobs.runtime)")
    run = subprocess.run([sys.executable, "-c", _FIRST_REQUESTS,
                          tiny_models["Qwen3ForCausalLM"], json.dumps(engine_args)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["at_start_up"] > 0  # the hook sees the engine's kernels
    assert (result["compiled"], result["graphs"]) == ([], 0)
