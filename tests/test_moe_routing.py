"""The routing functions pick the same experts with the same weights as the transformers gate of
each family (Qwen3-MoE, Mixtral, DeepSeek-V2 greedy / group-limited, DeepSeek-V3 noaux_tc),
on random router weights and hidden states. The order of a token's k experts is free, so rows
are compared sorted by expert id."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from hitchllm.layers.moe import grouped_topk, softmax_topk

HIDDEN, TOKENS = 32, 57


def _random_router(router: torch.nn.Module, seed: int) -> torch.Tensor:
    """Fill the gate with random weights; return random hidden states for it."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
    return torch.randn(TOKENS, HIDDEN, generator=gen)


def _by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids_sorted, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids_sorted


def assert_same_routing(ours, theirs) -> None:
    w_ours, id_ours = _by_expert(*ours)
    w_ref, id_ref = _by_expert(*theirs)
    assert torch.equal(id_ours, id_ref)
    torch.testing.assert_close(w_ours, w_ref.float(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_softmax_topk_matches_qwen3_moe_router(norm_topk_prob):
    config = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=8, num_experts_per_tok=3,
                                         norm_topk_prob=norm_topk_prob)
    router = Qwen3MoeTopKRouter(config)
    hidden = _random_router(router, 0)
    logits, weights, ids = router(hidden)
    assert_same_routing(softmax_topk(logits, 3, renormalize=norm_topk_prob), (weights, ids))


def test_softmax_topk_matches_mixtral_router():
    config = transformers.MixtralConfig(hidden_size=HIDDEN, num_local_experts=8,
                                        num_experts_per_tok=2)
    router = MixtralTopKRouter(config)
    hidden = _random_router(router, 1)
    logits, weights, ids = router(hidden)
    ours = softmax_topk(logits, 2, renormalize=True)
    assert_same_routing(ours, (weights, ids))
    torch.testing.assert_close(ours[0].sum(-1), torch.ones(TOKENS))


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_grouped_topk_matches_deepseek_v2_router(method):
    config = transformers.DeepseekV2Config(
        hidden_size=HIDDEN, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
        topk_group=2, topk_method=method, routed_scaling_factor=1.7,
    )
    router = DeepseekV2TopkRouter(config)
    hidden = _random_router(router, 2)
    logits, weights, ids = router(hidden)
    groups = (None, None) if method == "greedy" else (4, 2)
    ours = grouped_topk(logits, 4, *groups, scoring="softmax", renormalize=False,
                        routed_scaling_factor=1.7)
    assert_same_routing(ours, (weights, ids))


def test_group_limited_routing_keeps_experts_inside_the_best_groups():
    """The property behind group-limited greedy: with experts 0-3 and 4-7 as groups and the
    single best group kept, a token whose best expert (7) is in the second group gets only
    second-group experts, though expert 0 beats experts 4-6."""
    logits = torch.tensor([[3.0, -9, -9, -9, 1.0, 1.1, 1.2, 5.0]])
    _, ids = grouped_topk(logits, 2, num_expert_group=2, topk_group=1)
    assert sorted(ids[0].tolist()) == [6, 7]
    _, ids = grouped_topk(logits, 2)  # no groups: the global best two
    assert sorted(ids[0].tolist()) == [0, 7]


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_grouped_topk_matches_deepseek_v3_router(norm_topk_prob):
    config = transformers.DeepseekV3Config(
        hidden_size=HIDDEN, n_routed_experts=32, num_experts_per_tok=6, n_group=8,
        topk_group=3, norm_topk_prob=norm_topk_prob, routed_scaling_factor=2.5,
    )
    router = DeepseekV3TopkRouter(config)
    hidden = _random_router(router, 3)
    # A bias large enough to change the choice (a zero bias would not test its use).
    bias = torch.randn(32, generator=torch.Generator().manual_seed(4)) * 0.5
    router.e_score_correction_bias.copy_(bias)
    logits, weights, ids = router(hidden)
    ours = grouped_topk(logits, 6, 8, 3, scoring="sigmoid", correction_bias=bias,
                        renormalize=norm_topk_prob, routed_scaling_factor=2.5)
    assert_same_routing(ours, (weights, ids))
    unbiased = grouped_topk(logits, 6, 8, 3, scoring="sigmoid",
                            renormalize=norm_topk_prob, routed_scaling_factor=2.5)
    assert not torch.equal(_by_expert(*unbiased)[1], _by_expert(*ours)[1])


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda x: softmax_topk(x, 9, True), "top_k .9. must be between 1 and the number"),
        (lambda x: softmax_topk(x[0], 2, True), r"router_logits must be \[tokens, experts\]"),
        (lambda x: grouped_topk(x, 2, 3, 1), "8 experts do not split into 3 equal groups"),
        (lambda x: grouped_topk(x, 2, 4, 5), "topk_group is 5"),
        (lambda x: grouped_topk(x, 3, 4, 1), r"top_k \(3\) is more than the 2 experts"),
        (lambda x: grouped_topk(x, 2, correction_bias=torch.zeros(4)), "one bias per expert"),
        (lambda x: grouped_topk(x, 2, scoring="relu"), "unknown scoring 'relu'"),
    ],
)
def test_bad_routing_arguments_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call(torch.randn(5, 8))
