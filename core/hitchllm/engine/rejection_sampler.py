"""Verify draft tokens against the target distribution (speculative sampling).

A request with drafts ``d_0..d_{k-1}`` owns ``k + 1`` consecutive logits rows; row ``j`` is the
target's distribution ``p_j`` at draft ``j``'s position, computed as if ``d_0..d_{j-1}`` were
already output, and row ``k`` is the bonus position. ``rejection_sample`` picks one token per
row, all rows at once:

- a draft row emits ``d_j`` when accepted, which happens with probability
  ``min(1, p_j(d_j) / q_j(d_j))``; otherwise it emits a token drawn from the residual
  ``normalize(max(0, p_j - q_j))``, which never holds ``d_j``;
- the bonus row emits a token drawn from ``p_k``.

The host then keeps a request's tokens up to and including the first row whose token differs
from its draft (``PendingOutput.result``). The emitted sequence is distributed exactly as the
target's: the first rejected position emits ``p_j``'s mass that ``q_j`` did not cover, and the
positions after it are discarded, so rows computed for drafts that were never accepted do not
matter.

Without draft probabilities ``q_j`` is a point mass on ``d_j``: acceptance with probability
``p_j(d_j)`` and a residual of ``p_j`` without ``d_j``, the same formula.

Randomness: each row draws one ``Exp(1)`` per token (the sampler's noise; seeded rows from
their own generator). The residual is sampled with the exponential race over the columns other
than ``d_j``, and the acceptance test uses ``u = exp(-E[d_j])``, which is uniform on (0, 1] and
independent of the race, so speculation draws no extra random numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hitchllm.logits_processor import host_to_device


@dataclass
class DraftTokens:
    """The drafts of one step's logits rows, on the logits' device.

    ``token_ids`` is ``[N]`` int64: row ``j``'s draft, or -1 on a bonus row (a row with no
    draft to verify). ``probs`` is ``[N, V]`` float32, the draft distribution of each draft row
    (zeros on bonus rows), or None when every draft is a point mass.
    """

    token_ids: torch.Tensor
    probs: torch.Tensor | None = None


def build_draft_tokens(
    drafts: list[tuple[list[int], torch.Tensor | None]], vocab_size: int, device: torch.device
) -> DraftTokens:
    """Lay out the drafts of the sampling requests (in row order: each request's draft ids
    and their ``[k, V]`` probabilities or None) over their ``k + 1`` logits rows each."""
    row_ids: list[int] = []
    prob_rows: list[int] = []
    prob_parts: list[torch.Tensor] = []
    point_rows: list[int] = []
    point_ids: list[int] = []
    for ids, probs in drafts:
        start = len(row_ids)
        row_ids += ids
        row_ids.append(-1)
        if probs is None:
            point_rows += range(start, start + len(ids))
            point_ids += ids
        elif ids:
            prob_rows += range(start, start + len(ids))
            prob_parts.append(probs)
    token_ids = host_to_device(torch.tensor(row_ids, dtype=torch.int64), device)
    if not prob_parts:
        return DraftTokens(token_ids)
    probs = torch.zeros(len(row_ids), vocab_size, dtype=torch.float32, device=device)
    rows = host_to_device(torch.tensor(prob_rows, dtype=torch.int64), device)
    probs.index_copy_(0, rows, torch.cat(prob_parts).to(device, torch.float32))
    if point_rows:
        # Requests without draft probabilities, batched with ones that have them.
        index = host_to_device(torch.tensor([point_rows, point_ids], dtype=torch.int64), device)
        probs[index[0], index[1]] = 1.0
    return DraftTokens(token_ids, probs)


def rejection_sample(probs: torch.Tensor, noise: torch.Tensor, drafts: DraftTokens) -> torch.Tensor:
    """One token per row (see the module docstring).

    ``probs`` is ``[N, V]``, the target's distribution of each row as the sampler computed it;
    ``noise`` ``[N, V]`` positive ``Exp(1)`` draws. Returns ``[N]`` int64. No host sync.
    """
    has_draft = drafts.token_ids >= 0
    draft = drafts.token_ids.clamp_min(0)[:, None]
    p_draft = probs.gather(1, draft).squeeze(1)
    without_draft = probs.scatter(1, draft, 0.0)
    if drafts.probs is None:
        q_draft = torch.ones_like(p_draft)
        residual = without_draft
    else:
        q_draft = drafts.probs.gather(1, draft).squeeze(1)
        residual = (probs - drafts.probs).clamp_min(0.0).scatter(1, draft, 0.0)
        # A q that rounding puts at or above p everywhere leaves no mass (only when q ~ p and
        # then rejection is a rounding event): fall back to p without the draft.
        empty = residual.sum(dim=-1, keepdim=True) <= 0.0
        residual = torch.where(empty, without_draft, residual)
    uniform = torch.exp(-noise.gather(1, draft).squeeze(1))
    # u * q <= p accepts with probability min(1, p / q); p > 0 keeps a token the target
    # cannot emit (filtered out, masked by a grammar) from ever being accepted.
    accepted = has_draft & (p_draft > 0.0) & (uniform * q_draft <= p_draft)
    target = torch.where(has_draft[:, None], residual, probs)
    raced = (target / noise).argmax(dim=-1)
    return torch.where(accepted, drafts.token_ids, raced)
