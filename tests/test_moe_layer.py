"""``FusedMoE`` loads per-expert checkpoint tensors into its stacked weights and computes the
routed sum of a per-token float64 reference (both the grouped path and the dense path used
during CUDA graph capture); tensor-parallel ranks' partial outputs sum to the whole; a
checkpoint missing an expert's tensor is refused by name; a quantization method's
``get_moe_method`` replaces the computation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hitchllm import distributed
from hitchllm.layers import load_named_weights, process_weights_after_loading
from hitchllm.layers.moe import (
    FusedMoE,
    UnquantizedMoEMethod,
    dense_experts,
    expert_route,
    grouped_experts,
    softmax_topk,
)

E, H, INTER, K = 6, 16, 12, 2


def expert_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Checkpoint-style tensors of one MoE layer, Qwen/DeepSeek names, float64."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for e in range(E):
        for proj, shape in (("gate_proj", (INTER, H)), ("up_proj", (INTER, H)),
                            ("down_proj", (H, INTER))):
            tensors[f"mlp.experts.{e}.{proj}.weight"] = torch.randn(
                shape, generator=gen, dtype=torch.float64) / 3
    return tensors


def reference(hidden, weights, ids, tensors) -> torch.Tensor:
    """Token by token, expert by expert, in float64."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        x = hidden[t].double()
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate = tensors[f"mlp.experts.{e}.gate_proj.weight"] @ x
            up = tensors[f"mlp.experts.{e}.up_proj.weight"] @ x
            out[t] += weights[t, j].double() * (
                tensors[f"mlp.experts.{e}.down_proj.weight"] @ (F.silu(gate) * up))
    return out


class OneLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.Module()
        self.mlp.experts = FusedMoE(E, H, INTER, prefix="mlp.experts")


def load_layer(tensors, dtype=torch.float32) -> FusedMoE:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = OneLayer()
    finally:
        torch.set_default_dtype(previous)
    load_named_weights(model, tensors.items(), {}, skip=lambda n: False, description="test",
                       route=expert_route())
    return model.mlp.experts


def routed_batch(num_tokens: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, H, generator=gen)
    weights, ids = softmax_topk(torch.randn(num_tokens, E, generator=gen), K, renormalize=True)
    return hidden, weights, ids


@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_fused_moe_matches_per_token_reference(num_tokens):
    tensors = expert_tensors()
    layer = load_layer(tensors)
    hidden, weights, ids = routed_batch(num_tokens)
    assert len(ids.unique()) > 1 or num_tokens == 1
    out = layer(hidden, weights, ids)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(hidden, weights, ids, tensors),
                               rtol=1e-5, atol=1e-5)


def test_float64_layer_is_exact_and_dense_path_agrees():
    tensors = expert_tensors(2)
    layer = load_layer(tensors, torch.float64)
    hidden, weights, ids = routed_batch(23, seed=3)
    hidden = hidden.double()
    expected = reference(hidden, weights, ids, tensors)
    w13, w2 = layer.w13_weight, layer.w2_weight
    torch.testing.assert_close(grouped_experts(hidden, weights, ids, w13, w2), expected,
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dense_experts(hidden, weights, ids, w13, w2), expected,
                               rtol=1e-12, atol=1e-12)


def test_unrouted_experts_and_empty_batch():
    """Every token on expert 3 only: the others contribute nothing; zero tokens give zero rows."""
    tensors = expert_tensors(4)
    layer = load_layer(tensors)
    hidden = torch.randn(4, H)
    ids = torch.full((4, K), 3)
    weights = torch.full((4, K), 0.5)
    torch.testing.assert_close(layer(hidden, weights, ids).double(),
                               reference(hidden, weights, ids, tensors), rtol=1e-5, atol=1e-5)
    assert layer(hidden[:0], weights[:0], ids[:0]).shape == (0, H)


def test_mixtral_names_route_into_the_same_slots():
    route = expert_route("w1", "w3", "w2", module=("block_sparse_moe", "mlp"))
    assert route("model.layers.3.block_sparse_moe.experts.7.w1.weight") == (
        "model.layers.3.mlp.experts.w13_weight", (7, "gate"))
    assert route("model.layers.3.block_sparse_moe.experts.7.w3.weight") == (
        "model.layers.3.mlp.experts.w13_weight", (7, "up"))
    assert route("model.layers.3.block_sparse_moe.experts.7.w2.weight_scale") == (
        "model.layers.3.mlp.experts.w2_weight_scale", (7, "down"))
    assert route("model.layers.3.block_sparse_moe.gate.weight") is None
    assert expert_route()("model.layers.0.mlp.experts.0.w1.weight") is None


def test_missing_expert_tensor_is_named():
    tensors = expert_tensors()
    del tensors["mlp.experts.4.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing 1 tensors: mlp\.experts\.w13_weight\[\(4, "
                                         r"'up'\)\]"):
        load_layer(tensors)


def test_wrongly_shaped_expert_tensor_is_refused():
    tensors = expert_tensors()
    tensors["mlp.experts.2.down_proj.weight"] = torch.zeros(H, INTER + 1)
    with pytest.raises(ValueError, match=r"experts\.2\.down_proj.*expert 2 down.*expected 12"):
        load_layer(tensors)


@pytest.mark.parametrize("world_size", [2, 3])
def test_tensor_parallel_ranks_sum_to_the_whole(monkeypatch, world_size):
    """Each rank holds its slice of every expert's intermediate dimension; the partial outputs
    (collective replaced by the identity) sum to the unsharded layer's."""
    monkeypatch.setattr(distributed, "all_reduce", lambda x: x)
    tensors = expert_tensors(5)
    hidden, weights, ids = routed_batch(9, seed=6)
    total = torch.zeros(9, H, dtype=torch.float64)
    for rank in range(world_size):
        with distributed.tensor_parallel(rank, world_size):
            layer = load_layer(tensors, torch.float64)
        assert layer.w13_weight.shape == (E, 2 * INTER // world_size, H)
        total += layer(hidden.double(), weights, ids)
    torch.testing.assert_close(total, reference(hidden, weights, ids, tensors))


def test_indivisible_intermediate_size_is_refused():
    with distributed.tensor_parallel(0, 5), pytest.raises(ValueError, match="not divisible"):
        FusedMoE(E, H, INTER)


class TransposedMoEMethod(UnquantizedMoEMethod):
    """A method that repacks after loading (as a kernel would): experts' weights transposed."""

    def process_weights_after_loading(self, layer):
        layer.w13_t = layer.w13_weight.transpose(1, 2).contiguous()
        layer.w2_t = layer.w2_weight.transpose(1, 2).contiguous()
        layer.w13_weight.data.zero_()  # apply must not read the loaded layout any more

    def apply(self, layer, hidden, topk_weights, topk_ids):
        combine = torch.zeros(hidden.shape[0], layer.num_experts).scatter_add_(
            1, topk_ids, topk_weights.float())
        gate_up = torch.einsum("th,ehi->tei", hidden, layer.w13_t)
        gate, up = gate_up.chunk(2, dim=-1)
        down = torch.einsum("tei,eih->teh", F.silu(gate) * up, layer.w2_t)
        return (down * combine.unsqueeze(-1)).sum(1)


class MoEQuantConfig:
    def __init__(self) -> None:
        self.prefixes: list[str] = []

    def get_linear_method(self, layer, prefix):
        return None

    def get_moe_method(self, layer, prefix):
        self.prefixes.append(prefix)
        return TransposedMoEMethod()


def test_quant_config_supplies_the_moe_method():
    """``get_moe_method`` chooses the layer's method, which gets its
    ``process_weights_after_loading`` call and then computes the layer's output."""
    quant = MoEQuantConfig()
    model = torch.nn.Module()
    model.mlp = torch.nn.Module()
    model.mlp.experts = FusedMoE(E, H, INTER, quant_config=quant, prefix="mlp.experts")
    assert quant.prefixes == ["mlp.experts"]
    tensors = expert_tensors(7)
    load_named_weights(model, tensors.items(), {}, skip=lambda n: False, description="test",
                       route=expert_route())
    process_weights_after_loading(model)
    hidden, weights, ids = routed_batch(11, seed=8)
    out = model.mlp.experts(hidden, weights, ids)
    torch.testing.assert_close(out.double(), reference(hidden, weights, ids, tensors),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_cuda_graph_capture_uses_the_dense_path():
    """Captured in a CUDA graph (no host read possible), the layer replays the routed sum."""
    tensors = expert_tensors(9)
    with torch.device("cuda"):
        layer = load_layer(tensors)
    hidden, weights, ids = (t.cuda() for t in routed_batch(8, seed=10))
    eager = layer(hidden, weights, ids)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(hidden, weights, ids)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer(hidden, weights, ids)
    new_hidden, new_weights, new_ids = (t.cuda() for t in routed_batch(8, seed=11))
    hidden.copy_(new_hidden)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    torch.testing.assert_close(captured.double().cpu(),
                               reference(new_hidden.cpu(), new_weights.cpu(), new_ids.cpu(),
                                         tensors), rtol=1e-4, atol=1e-4)
    assert not torch.equal(eager, captured)
