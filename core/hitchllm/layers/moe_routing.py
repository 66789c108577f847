"""Mixture-of-experts routing: router logits to each token's experts and their weights.

Each function takes ``router_logits [T, num_experts]`` and returns ``(topk_weights [T, k]
float32, topk_ids [T, k] int64)``, batched over tokens (no Python loop per token), with the
semantics of the Hugging Face transformers gate of each family (the tests compare them):

- ``softmax_topk``: softmax over all experts, the ``k`` largest, optionally renormalized to sum
  to one (Mixtral always renormalizes; Qwen3-MoE when ``norm_topk_prob``).
- ``grouped_topk``: DeepSeek's routers. Experts form ``num_expert_group`` groups; a token first
  keeps its ``topk_group`` best groups, then its ``k`` best experts inside them.
  DeepSeek-V2 ``greedy`` is one group; ``group_limited_greedy`` scores a group by its best
  softmax score. DeepSeek-V3 ``noaux_tc`` scores with sigmoids, adds ``correction_bias``
  (``e_score_correction_bias``) for the choice only, scores a group by the sum of its two best
  biased scores, and weights the chosen experts by their unbiased scores.

The order of the ``k`` experts of a token is unspecified (the expert layer sums over them).
"""

from __future__ import annotations

from typing import Literal

import torch


def softmax_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax (in float32) over experts, then the ``top_k`` largest probabilities; with
    ``renormalize`` they are divided by their sum."""
    _check_top_k(router_logits, top_k)
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_topk(
    router_logits: torch.Tensor,
    top_k: int,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    scoring: Literal["softmax", "sigmoid"] = "softmax",
    correction_bias: torch.Tensor | None = None,
    renormalize: bool = False,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's group-limited top-k.

    Scores are ``softmax`` or ``sigmoid`` of the float32 logits. The choice uses ``scores +
    correction_bias`` when a bias ``[num_experts]`` is given (V3's ``noaux_tc``; a group then
    scores the sum of its two best biased scores), else the scores (a group scores its best
    one: V2's ``group_limited_greedy``). ``num_expert_group`` None or 1 is no grouping (V2's
    ``greedy``). The weights are the chosen experts' unbiased scores, divided by their sum
    when ``renormalize`` (``norm_topk_prob``), times ``routed_scaling_factor``.
    """
    _check_top_k(router_logits, top_k)
    num_experts = router_logits.shape[-1]
    logits = router_logits.float()
    if scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        raise ValueError(f"unknown scoring {scoring!r}; use 'softmax' or 'sigmoid'")
    if correction_bias is not None and correction_bias.shape != (num_experts,):
        raise ValueError(f"correction_bias has shape {tuple(correction_bias.shape)}, expected "
                         f"({num_experts},): one bias per expert")
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_expert_group is not None and num_expert_group > 1:
        choice = _mask_to_best_groups(choice, num_expert_group, topk_group, top_k,
                                      by_top2_sum=correction_bias is not None)
    ids = torch.topk(choice, top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def _mask_to_best_groups(
    choice: torch.Tensor, num_groups: int, topk_group: int | None, top_k: int,
    by_top2_sum: bool,
) -> torch.Tensor:
    """``choice`` with every expert outside the token's ``topk_group`` best groups at -inf."""
    num_tokens, num_experts = choice.shape
    if num_experts % num_groups:
        raise ValueError(f"{num_experts} experts do not split into {num_groups} equal groups "
                         "(n_group); use an n_group that divides the number of experts")
    per_group = num_experts // num_groups
    if topk_group is None or not 1 <= topk_group <= num_groups:
        raise ValueError(f"topk_group is {topk_group}; it must be between 1 and the number of "
                         f"expert groups ({num_groups})")
    if topk_group * per_group < top_k:
        raise ValueError(f"top_k ({top_k}) is more than the {topk_group * per_group} experts of "
                         f"the topk_group={topk_group} groups a token keeps")
    grouped = choice.view(num_tokens, num_groups, per_group)
    if by_top2_sum:
        group_scores = grouped.topk(min(2, per_group), dim=-1)[0].sum(dim=-1)
    else:
        group_scores = grouped.max(dim=-1).values
    best = torch.topk(group_scores, topk_group, dim=-1)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(num_tokens, num_experts)


def _check_top_k(router_logits: torch.Tensor, top_k: int) -> None:
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [tokens, experts], got shape "
                         f"{tuple(router_logits.shape)}")
    if not 1 <= top_k <= router_logits.shape[-1]:
        raise ValueError(f"top_k ({top_k}) must be between 1 and the number of experts "
                         f"({router_logits.shape[-1]})")
