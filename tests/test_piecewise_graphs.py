"""Piecewise CUDA graphs of prompt and mixed steps: the token-size ladder, which models can
be split, and the padded step they replay (runs on the CPU: padding tokens that attention does
not see must leave the real tokens' results as they are). The captured graphs themselves are
tested on the GPU (tests/test_gpu_graphs.py)."""

from __future__ import annotations

import pytest
import torch
from test_models_hf_parity import mixed_prompts

from hitchllm import LLM, SamplingParams
from hitchllm.attention import Attention, real_rows, set_forward_context
from hitchllm.engine import piecewise_graphs
from hitchllm.engine.piecewise_graphs import (
    PieceGraphs,
    RowAttention,
    can_split,
    default_token_sizes,
)


def test_token_size_ladder():
    assert default_token_sizes(8192) == [16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536,
                                         2048, 3072, 4096, 6144, 8192]
    assert default_token_sizes(100) == [16, 32, 64, 100]
    assert default_token_sizes(600) == [16, 32, 64, 128, 192, 256, 384, 512, 600]
    assert default_token_sizes(16) == [16]
    assert default_token_sizes(5) == [5]


def test_a_step_runs_at_the_smallest_size_that_holds_it():
    pieces = PieceGraphs([64, 16, 32])
    assert [pieces.padded_tokens(n) for n in (1, 16, 17, 33, 64, 65)] == [16, 16, 32, 64, 64,
                                                                           None]
    assert not pieces.captured


class OwnForward(Attention):
    def forward(self, q, k, v):
        return q


def test_only_core_attention_layers_in_one_process_split(monkeypatch):
    layers = [Attention(2, 8, 1, 0.3, i) for i in range(2)]
    assert can_split(torch.nn.Module(), layers) is None
    assert "no attention layers" in can_split(torch.nn.Module(), [])
    reason = can_split(torch.nn.Module(), [layers[0], OwnForward(2, 8, 1, 0.3, 1)])
    assert "OwnForward" in reason

    # Experts that run densely under capture (the torch MoE method) would make every
    # replayed prompt step compute every expert on every token.
    from hitchllm.layers.moe import UnquantizedMoEMethod

    class Experts(torch.nn.Module):
        def __init__(self, method):
            super().__init__()
            self.moe_method = method

    class Fused(UnquantizedMoEMethod):
        dense_under_capture = False

    model = torch.nn.Sequential(Experts(UnquantizedMoEMethod()))
    assert "UnquantizedMoEMethod" in can_split(model, layers)
    assert can_split(torch.nn.Sequential(Experts(Fused())), layers) is None

    class Rank:
        world_size = 2

    monkeypatch.setattr(piecewise_graphs.distributed, "current_rank", lambda: Rank())
    assert "parallel" in can_split(torch.nn.Module(), layers)


def test_split_attention_replaces_the_layers_attention():
    layer = Attention(2, 4, 1, 0.5, 0)
    q, k, v = torch.randn(5, 8), torch.randn(5, 4), torch.randn(5, 4)
    calls = []
    with set_forward_context(None, split_attention=lambda *a: calls.append(a) or a[1] * 2):
        out = layer(q, k, v)
    assert torch.equal(out, q * 2) and calls[0][0] is layer
    with set_forward_context(None), pytest.raises(RuntimeError, match="no backend bound"):
        layer(q, k, v)


def test_row_attention_attends_over_the_real_rows_and_zeroes_the_padding():
    layer = Attention(2, 4, 1, 0.5, 0)
    seen = []
    layer.attend = lambda q, k, v: seen.append(q.shape[0]) or q + 1
    q, k, v = torch.randn(8, 8), torch.randn(8, 4), torch.randn(8, 4)
    out = RowAttention(3)(layer, q, k, v)
    assert seen == [3]
    assert torch.equal(out[:3], q[:3] + 1) and not out[3:].any()
    into = torch.full((8, 8), 7.0)
    rows = RowAttention(5)
    rows.into = into
    assert rows(layer, q, k, v) is into and torch.equal(into[:5], q[:5] + 1)
    assert not into[5:].any()


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "LlamaForCausalLM"])
def test_padded_prompt_steps_give_the_tokens_of_unpadded_ones(tiny_models, arch, monkeypatch):
    """What a replay computes, run eagerly: chunked prompts (budget 40 tokens), mixed steps
    and a prefix-cache hit, padded to the ladder, give the unpadded engine's greedy tokens."""
    prompts = mixed_prompts(5, lengths=(3, 57, 20, 9, 31))
    prompts.append([*prompts[1][:40], 7, 8, 9])  # shares a cached prefix with prompt 1
    kwargs = dict(device="cpu", dtype="float32", max_num_batched_tokens=40,
                  enable_prefix_caching=True)
    plain = LLM(tiny_models[arch], **kwargs)
    padded = LLM(tiny_models[arch], **kwargs)
    runner = padded.engine.executor.runner
    assert plain.engine.executor.runner.pieces is None  # CPU engines run steps unpadded
    runner.pieces = PieceGraphs(default_token_sizes(40))
    expected = _generate(plain, prompts)
    attended = []
    real_attend = Attention.attend
    monkeypatch.setattr(Attention, "attend",
                        lambda self, q, k, v: attended.append(q.shape[0])
                        or real_attend(self, q, k, v))
    real = []  # what hooks on the layers see as real rows (fp8 KV-scale calibration does)
    for layer in runner.layers:
        layer.register_forward_pre_hook(lambda m, args: real.append(real_rows(args[1]).shape[0]))
    padded_tokens = []
    real_model = runner.model.forward
    monkeypatch.setattr(runner.model, "forward",
                        lambda ids, pos: padded_tokens.append(ids.shape[0])
                        or real_model(ids, pos))
    assert _generate(padded, prompts) == expected
    # Steps ran at the ladder's sizes while attention saw fewer tokens.
    assert set(padded_tokens) <= {16, 32, 40} and 40 in padded_tokens
    assert any(n not in (16, 32, 40) for n in attended)
    assert real == attended
