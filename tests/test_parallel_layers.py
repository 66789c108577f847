"""The linear and vocabulary layers slice checkpoint tensors per tensor-parallel rank so that
the ranks' shards put back together are the full weight, and their outputs put back together
(concatenated for column-parallel, summed for row-parallel) equal the unsharded layer in
float64. Each rank of a pretend world of 2 or 4 is built in ``distributed.tensor_parallel``;
the collectives are replaced by the identity so that each rank's own output can be checked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from hitchllm import distributed
from hitchllm.config import ModelConfig
from hitchllm.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    set_weight_attrs,
)
from hitchllm.models.llama import LlamaForCausalLM
from hitchllm.tiny_model import build_tiny_checkpoint

WORLD_SIZES = [2, 4]
HIDDEN = 8


@pytest.fixture(autouse=True)
def _float64_and_local_collectives(monkeypatch):
    """Layers in float64; each rank's collective returns its own part, for the test to
    combine."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    monkeypatch.setattr(distributed, "all_reduce", lambda x: x)
    monkeypatch.setattr(distributed, "all_gather", lambda x, dim=-1: x)
    yield
    torch.set_default_dtype(previous)


def ranks(world_size: int, build):
    """``build()`` for every rank of a world of ``world_size``."""
    layers = []
    for rank in range(world_size):
        with distributed.tensor_parallel(rank, world_size):
            layers.append(build())
    return layers


def load(layer, name: str, tensor: torch.Tensor, shard_id=None) -> None:
    param = getattr(layer, name)
    param.weight_loader(param, tensor, shard_id)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_column_parallel_shards_concatenate_to_the_full_layer(world_size):
    w, b, x = randn(12, HIDDEN), randn(12), randn(5, HIDDEN)
    layers = ranks(world_size, lambda: ColumnParallelLinear(HIDDEN, 12, bias=True))
    for layer in layers:
        load(layer, "weight", w)
        load(layer, "bias", b)
    assert torch.equal(torch.cat([layer.weight for layer in layers]), w)
    assert torch.equal(torch.cat([layer.bias for layer in layers]), b)
    out = torch.cat([layer(x) for layer in layers], dim=-1)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_row_parallel_partial_outputs_sum_to_the_full_layer(world_size):
    w, b, x = randn(6, 12), randn(6), randn(5, 12)
    layers = ranks(world_size, lambda: RowParallelLinear(12, 6, bias=True))
    for layer in layers:
        load(layer, "weight", w)
        load(layer, "bias", b)
    assert torch.equal(torch.cat([layer.weight for layer in layers], dim=1), w)
    size = 12 // world_size
    partial = [layer(x[:, r * size : (r + 1) * size]) for r, layer in enumerate(layers)]
    torch.testing.assert_close(sum(partial), F.linear(x, w, b), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_merged_gate_up_slots_shard_separately(world_size):
    gate, up, x = randn(8, HIDDEN), randn(12, HIDDEN), randn(5, HIDDEN)
    layers = ranks(world_size, lambda: MergedColumnParallelLinear(HIDDEN, [8, 12]))
    for layer in layers:
        load(layer, "weight", gate, 0)
        load(layer, "weight", up, 1)
    sizes = [8 // world_size, 12 // world_size]
    parts = [layer.weight.split(sizes) for layer in layers]
    assert torch.equal(torch.cat([p[0] for p in parts]), gate)
    assert torch.equal(torch.cat([p[1] for p in parts]), up)
    outs = [layer(x).split(sizes, dim=-1) for layer in layers]
    full = torch.cat([torch.cat([o[0] for o in outs], -1), torch.cat([o[1] for o in outs], -1)], -1)
    expected = F.linear(x, torch.cat([gate, up]))
    torch.testing.assert_close(full, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("world_size", "kv_heads"), [(2, 2), (2, 4), (4, 4), (4, 2), (4, 1)])
def test_qkv_slots_shard_by_head_and_replicate_scarce_kv_heads(world_size, kv_heads):
    head, heads = 3, 8
    wq, wk, wv = randn(heads * head, HIDDEN), randn(kv_heads * head, HIDDEN), randn(
        kv_heads * head, HIDDEN)
    bias = randn((heads + 2 * kv_heads) * head)
    layers = ranks(world_size,
                   lambda: QKVParallelLinear(HIDDEN, head, heads, kv_heads, bias=True))
    for layer in layers:
        for slot, tensor in zip("qkv", (wq, wk, wv), strict=True):
            load(layer, "weight", tensor, slot)
        load(layer, "bias", bias)  # a fused checkpoint tensor: every slot at once
    local_kv = max(kv_heads // world_size, 1)
    replicas = max(world_size // kv_heads, 1)
    assert all(layer.num_kv_heads == local_kv for layer in layers)
    sizes = [heads // world_size * head, local_kv * head, local_kv * head]
    q, k, v = zip(*(layer.weight.split(sizes) for layer in layers), strict=True)
    assert torch.equal(torch.cat(q), wq)
    # Each KV head lives on `replicas` consecutive ranks; one of each group rebuilds it.
    for r in range(world_size):
        assert torch.equal(k[r], k[r // replicas * replicas])
    assert torch.equal(torch.cat(k[::replicas]), wk)
    assert torch.equal(torch.cat(v[::replicas]), wv)
    fused = [layer.bias.split(sizes) for layer in layers]
    bq, bk, bv = bias.split([heads * head, kv_heads * head, kv_heads * head])
    assert torch.equal(torch.cat([f[0] for f in fused]), bq)
    assert torch.equal(torch.cat([f[1] for f in fused][::replicas]), bk)
    assert torch.equal(torch.cat([f[2] for f in fused][::replicas]), bv)

    x = randn(5, HIDDEN)
    outs = [layer(x).split(sizes, dim=-1) for layer in layers]
    for i, (w, b) in enumerate(((wq, bq), (wk, bk), (wv, bv))):
        kept = outs if i == 0 else outs[::replicas]
        got = torch.cat([o[i] for o in kept], dim=-1)
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("world_size", "kv_heads", "message"), [
    (2, 3, "number of key/value heads \\(3\\) is not divisible"),
    (4, 3, "3 key/value heads cannot be replicated evenly over 4"),
])
def test_qkv_refuses_kv_heads_that_do_not_split(world_size, kv_heads, message):
    with pytest.raises(ValueError, match=message):
        ranks(world_size, lambda: QKVParallelLinear(HIDDEN, 2, 12, kv_heads))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_replicated_linear_holds_the_whole_weight_on_every_rank(world_size):
    w, x = randn(6, HIDDEN), randn(5, HIDDEN)
    for layer in ranks(world_size, lambda: ReplicatedLinear(HIDDEN, 6)):
        load(layer, "weight", w)
        torch.testing.assert_close(layer(x), F.linear(x, w), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_vocab_partitions_are_padded_and_recombine(world_size):
    vocab = 10  # not a multiple of 4: the last partition is padded
    table, hidden = randn(vocab, HIDDEN), randn(5, HIDDEN)
    ids = torch.tensor([0, 3, 9, 5, 5, 7])
    per = -(-vocab // world_size)
    embeds = ranks(world_size, lambda: VocabParallelEmbedding(vocab, HIDDEN))
    heads = ranks(world_size, lambda: ParallelLMHead(vocab, HIDDEN))
    for layer in embeds + heads:
        load(layer, "weight", table)
        assert layer.weight.shape == (per, HIDDEN)
    padded = torch.cat([layer.weight for layer in embeds])
    assert torch.equal(padded[:vocab], table)
    assert not padded[vocab:].any()
    embedded = sum(layer(ids) for layer in embeds)
    torch.testing.assert_close(embedded, F.embedding(ids, table), rtol=0, atol=0)
    logits = torch.cat([layer(hidden) for layer in heads], dim=-1)[:, :vocab]
    torch.testing.assert_close(logits, F.linear(hidden, table), rtol=1e-12, atol=1e-12)


def test_world_size_one_is_a_plain_matmul_without_collectives(monkeypatch):
    def collective(*args, **kwargs):
        raise AssertionError("a world of one needs no collective")

    monkeypatch.setattr(distributed, "all_reduce", collective)
    monkeypatch.setattr(distributed, "all_gather", collective)
    w, x = randn(6, HIDDEN), randn(5, HIDDEN)
    row = RowParallelLinear(HIDDEN, 6)
    load(row, "weight", w)
    head = ParallelLMHead(6, HIDDEN)
    load(head, "weight", w)
    embed = VocabParallelEmbedding(6, HIDDEN)
    load(embed, "weight", w)
    assert torch.equal(row(x), F.linear(x, w))
    assert torch.equal(head(x), F.linear(x, w))
    assert torch.equal(embed(torch.tensor([1, 5])), w[[1, 5]])


def test_more_than_one_rank_refuses_to_return_partial_results(monkeypatch):
    # A pretend world of 2 has no process group: a collective must fail loudly rather than
    # return one rank's partial sum.
    monkeypatch.undo()  # the real collectives, not the fixture's local ones
    with distributed.tensor_parallel(0, 2), pytest.raises(RuntimeError,
                                                          match="outside a process group"):
        RowParallelLinear(4, 2)(randn(1, 2))


def test_a_tensor_of_the_wrong_shape_is_refused_with_both_shapes():
    layer = QKVParallelLinear(HIDDEN, 2, 4, 2)
    with pytest.raises(ValueError, match="expected 4"):
        load(layer, "weight", randn(6, HIDDEN), "k")
    with pytest.raises(ValueError, match=r"shape \(4, 7\) does not fit \(4, 8\)"):
        load(layer, "weight", randn(4, 7), "v")
    with pytest.raises(ValueError, match="unknown slot 'x'"):
        load(layer, "weight", randn(4, HIDDEN), "x")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_each_rank_of_a_model_loads_its_shards_of_the_checkpoint(tmp_path, world_size):
    """The Llama family's load_weights routes names only; the layers' loaders give every rank
    its heads (KV heads replicated: 2 of them over 4 ranks), MLP columns and vocabulary rows."""
    torch.set_default_dtype(torch.float32)  # a float32 checkpoint, as a user would have
    path = build_tiny_checkpoint(tmp_path / "m", "Qwen2ForCausalLM", seed=2)
    torch.set_default_dtype(torch.float64)
    config = ModelConfig.from_pretrained(path)
    state = {n: t.double() for n, t in load_file(str(path / "model.safetensors")).items()}
    # transformers initializes biases to zero; random ones show that they are sliced too.
    state.update({n: randn(*t.shape) for n, t in state.items() if n.endswith(".bias")})
    models = ranks(world_size, lambda: LlamaForCausalLM(config))
    for model in models:
        model.load_weights(iter(state.items()))
    prefix = "model.layers.1."
    attn = [m.model.layers[1].self_attn for m in models]
    heads, kv_heads, head = (config.num_attention_heads, config.num_key_value_heads,
                             config.head_dim)
    replicas = max(world_size // kv_heads, 1)
    sizes = [heads // world_size * head, attn[0].kv_size, attn[0].kv_size]
    for param in ("weight", "bias"):
        q, k, v = zip(*(getattr(a.qkv_proj, param).split(sizes) for a in attn), strict=True)
        assert torch.equal(torch.cat(q), state[f"{prefix}self_attn.q_proj.{param}"])
        assert torch.equal(torch.cat(k[::replicas]), state[f"{prefix}self_attn.k_proj.{param}"])
        assert torch.equal(torch.cat(v[::replicas]), state[f"{prefix}self_attn.v_proj.{param}"])
    assert torch.equal(torch.cat([a.o_proj.weight for a in attn], dim=1),
                       state[f"{prefix}self_attn.o_proj.weight"])
    inter = config.intermediate_size // world_size
    gate, up = zip(*(m.model.layers[1].mlp.gate_up_proj.weight.split(inter) for m in models),
                   strict=True)
    assert torch.equal(torch.cat(gate), state[f"{prefix}mlp.gate_proj.weight"])
    assert torch.equal(torch.cat(up), state[f"{prefix}mlp.up_proj.weight"])
    vocab = config.vocab_size
    rows = torch.cat([m.lm_head.weight for m in models])
    assert torch.equal(rows[:vocab], state["lm_head.weight"]) and not rows[vocab:].any()


PACK = 2


def packed(weight: torch.Tensor) -> torch.Tensor:
    """A stand-in for int4 packing in the layout AWQ uses: ``[input, output // PACK]``, each
    element standing for ``PACK`` consecutive output rows (here: their sum)."""
    return weight.T.reshape(weight.shape[1], -1, PACK).sum(-1)


def add_packed_param(layer) -> torch.nn.Parameter:
    """The layer's packed twin of its weight, loaded through the layer's own loader."""
    rows = layer.weight.shape[0]
    param = torch.nn.Parameter(torch.zeros(layer.input_size_per_partition, rows // PACK),
                               requires_grad=False)
    set_weight_attrs(param, weight_loader=layer.weight_loader, output_dim=1, input_dim=0,
                     packed_dim=1, pack_factor=PACK)
    layer.register_parameter("packed", param)
    return param


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("kind", ["qkv", "gate_up", "column", "row"])
def test_packed_output_parameters_load_the_packed_slices_of_every_slot(world_size, kind):
    """A parameter packing ``pack_factor`` output rows per element (``packed_dim``) gets, on
    every rank and in every stacked slot, exactly the packing of the rows an unpacked weight
    gets there: slot offsets and rank slices are counted in packed elements."""
    builders = {
        "qkv": (lambda: QKVParallelLinear(HIDDEN, 4, 8, 2), {"q": 32, "k": 8, "v": 8}),
        "gate_up": (lambda: MergedColumnParallelLinear(HIDDEN, [8, 12]), {0: 8, 1: 12}),
        "column": (lambda: ColumnParallelLinear(HIDDEN, 12), {None: 12}),
        "row": (lambda: RowParallelLinear(HIDDEN, 12), {None: 12}),
    }
    build, slots = builders[kind]
    tensors = {slot: randn(rows, HIDDEN) for slot, rows in slots.items()}
    for layer in ranks(world_size, build):
        param = add_packed_param(layer)
        for slot, tensor in tensors.items():
            load(layer, "weight", tensor, slot)
            param.weight_loader(param, packed(tensor), slot)
        assert torch.equal(param.data, packed(layer.weight.data))


def test_a_slot_that_is_not_a_whole_number_of_packed_elements_is_refused():
    layer = QKVParallelLinear(HIDDEN, 3, 4, 2)  # k and v slots of 6 rows: 1.5 elements of 4
    param = torch.nn.Parameter(torch.zeros(HIDDEN, 6), requires_grad=False)
    set_weight_attrs(param, weight_loader=layer.weight_loader, output_dim=1, input_dim=0,
                     packed_dim=1, pack_factor=4)
    with pytest.raises(ValueError, match="slot 'k' has size 6 .* pack factor 4"):
        param.weight_loader(param, randn(HIDDEN, 1), "k")
    with pytest.raises(ValueError, match="slot 'k' has size 6 along the output, not a multiple"):
        param.weight_loader(param, randn(HIDDEN, 6), None)
