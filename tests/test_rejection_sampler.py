"""The rejection sampler emits the target's distribution whatever the draft distribution.

Reference: exact float64 probabilities from fixed logits. Drafts are sampled from a draft
distribution q that differs from the target p (and gives mass to a token the target filters
out); the sampler runs on ~100k requests at once and the emitted tokens' frequencies must match
p within a chi-square bound at about five sigma.
"""

from __future__ import annotations

import math

import torch

from hitchllm.engine.rejection_sampler import DraftTokens, build_draft_tokens
from hitchllm.engine.sampler import Sampler
from hitchllm.engine.sampling_metadata import SamplingMetadata

V = 6
N = 100_000
TARGET = torch.tensor([1.2, 0.3, -0.5, 2.0, 0.0, -1.5])
DRAFT = torch.tensor([-0.4, 1.5, 0.6, 0.1, 0.0, 0.8])
CPU = torch.device("cpu")


def exact_probs(logits: torch.Tensor, temperature: float, top_k: int = 0) -> torch.Tensor:
    """The target's distribution in float64: temperature, then keep the top-k logits."""
    x = logits.double() / temperature
    if top_k:
        kth = x.topk(top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    return x.softmax(dim=-1)


def metadata(
    n: int, temperature: float, top_k: int, drafts: DraftTokens, gen: torch.Generator
) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=torch.full((n,), temperature),
        all_greedy=False,
        all_random=True,
        top_k=torch.full((n,), top_k, dtype=torch.int64) if top_k else None,
        default_generator=gen,
        drafts=drafts,
    )


def interleave(*columns: torch.Tensor) -> torch.Tensor:
    """Rows ``a_0, b_0, a_1, b_1, ...`` from per-request columns of equal length."""
    return torch.stack(columns, dim=1).flatten(0, 1)


def chi_square_bound(df: int, z: float = 5.0) -> float:
    """The chi-square quantile ``z`` standard deviations out (Wilson-Hilferty)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom; a cell of probability 0 must be empty."""
    counts, probs = counts.double(), probs.double().flatten()
    counts = counts.flatten()
    assert counts[probs == 0].sum() == 0, "a token the target cannot emit was emitted"
    support = probs > 0
    expected = probs[support] * counts.sum()
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return stat, int(support.sum()) - 1


def assert_distribution(counts: torch.Tensor, probs: torch.Tensor) -> None:
    stat, df = chi_square(counts, probs)
    assert stat < chi_square_bound(df), (stat, df, counts, probs)


def test_first_token_follows_target_for_a_different_draft_distribution():
    gen = torch.Generator().manual_seed(0)
    temperature, top_k = 0.8, 5  # top-k drops token 5, which the draft proposes often
    p = exact_probs(TARGET, temperature, top_k)
    q = DRAFT.softmax(-1)
    d0 = torch.multinomial(q, N, replacement=True, generator=gen)
    drafts = DraftTokens(
        interleave(d0, torch.full((N,), -1)), interleave(q.expand(N, V), torch.zeros(N, V))
    )
    logits = interleave(TARGET.expand(N, V), TARGET.expand(N, V))
    tokens = Sampler()(logits, metadata(2 * N, temperature, top_k, drafts, gen))
    first = tokens.sampled_token_ids.view(N, 2)[:, 0]
    assert_distribution(torch.bincount(first, minlength=V), p)
    # Acceptance rate of speculative sampling: sum_x min(p(x), q(x)).
    accepted = (first == d0).double().mean()
    expected = torch.minimum(p, q.double()).sum()
    assert abs(accepted - expected) < 5 * math.sqrt(expected * (1 - expected) / N)


def test_drafts_without_probs_are_verified_exactly_but_accepted_less_often():
    """Sampled drafts verified as point masses (a proposer that gives no probs): the emitted
    token still follows the target, but a draft survives only with probability p(d), so the
    acceptance rate is sum_x p(x) q(x) instead of sum_x min(p(x), q(x))."""
    gen = torch.Generator().manual_seed(5)
    p = exact_probs(TARGET, 1.0)
    q = DRAFT.softmax(-1)
    d0 = torch.multinomial(q, N, replacement=True, generator=gen)
    drafts = DraftTokens(interleave(d0, torch.full((N,), -1)))
    logits = interleave(TARGET.expand(N, V), TARGET.expand(N, V))
    first = Sampler()(logits, metadata(2 * N, 1.0, 0, drafts, gen)).sampled_token_ids[::2]
    assert_distribution(torch.bincount(first, minlength=V), p)
    accepted = (first == d0).double().mean()
    expected = (p * q.double()).sum()
    assert abs(accepted - expected) < 5 * math.sqrt(expected * (1 - expected) / N)
    assert expected < torch.minimum(p, q.double()).sum() - 0.1


def test_two_drafts_give_the_targets_joint_distribution():
    """k = 2; the target at the second position depends on the first token, and so does the
    draft. A request whose first draft is rejected gets its second token in the next step,
    sampled from the target given the token it emitted."""
    gen = torch.Generator().manual_seed(1)
    temperature = 0.9
    target_2 = torch.randn(V, V, generator=gen) * 1.5  # row t: logits after token t
    draft_2 = torch.randn(V, V, generator=gen) * 1.5
    bonus = torch.randn(V, generator=gen)
    q1 = DRAFT.softmax(-1)
    q2 = draft_2.softmax(-1)
    d0 = torch.multinomial(q1, N, replacement=True, generator=gen)
    d1 = torch.multinomial(q2[d0], 1, generator=gen).squeeze(1)
    drafts = DraftTokens(
        interleave(d0, d1, torch.full((N,), -1)),
        interleave(q1.expand(N, V), q2[d0], torch.zeros(N, V)),
    )
    logits = interleave(TARGET.expand(N, V), target_2[d0], bonus.expand(N, V))
    sampler = Sampler()
    rows = sampler(logits, metadata(3 * N, temperature, 0, drafts, gen)).sampled_token_ids
    t0, t1 = rows.view(N, 3)[:, 0], rows.view(N, 3)[:, 1]
    next_step = sampler(
        target_2[t0],
        SamplingMetadata(
            temperature=torch.full((N,), temperature),
            all_greedy=False,
            all_random=True,
            default_generator=gen,
        ),
    ).sampled_token_ids
    t1 = torch.where(t0 == d0, t1, next_step)
    joint = exact_probs(TARGET, temperature)[:, None] * exact_probs(target_2, temperature)
    assert_distribution(torch.bincount(t0 * V + t1, minlength=V * V), joint)


def test_draft_equal_to_target_is_always_accepted():
    gen = torch.Generator().manual_seed(2)
    temperature, top_k = 0.7, 4
    logits = TARGET.expand(N, V)
    # The target's distribution exactly as the sampler computes it, in float32.
    keep = TARGET.topk(top_k).values[-1] <= TARGET
    p = (TARGET / temperature).masked_fill(~keep, float("-inf")).softmax(-1)
    d0 = torch.multinomial(p, N, replacement=True, generator=gen)
    drafts = DraftTokens(
        interleave(d0, torch.full((N,), -1)), interleave(p.expand(N, V), torch.zeros(N, V))
    )
    tokens = Sampler()(
        interleave(logits, logits), metadata(2 * N, temperature, top_k, drafts, gen)
    ).sampled_token_ids
    assert torch.equal(tokens[::2], d0)


def test_seeded_rows_with_draft_probs_do_not_depend_on_the_batch():
    """A seeded request's tokens depend on its logits, drafts and seed only."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, V, generator=gen)
    q = torch.rand(2, V, generator=gen)
    q = q / q.sum(-1, keepdim=True)
    seeded = ([1, 4], q)

    def run(others: list[tuple[list[int], torch.Tensor | None]], at: int) -> torch.Tensor:
        requests = [*others[:at], seeded, *others[at:]]
        rows = torch.cat(
            [logits if r is seeded else torch.randn(len(r[0]) + 1, V) for r in requests]
        )
        start = sum(len(d) + 1 for d, _ in requests[:at])
        mine = torch.Generator().manual_seed(11)
        md = SamplingMetadata(
            temperature=torch.ones(len(rows)),
            all_greedy=False,
            all_random=True,
            generators={start + j: mine for j in range(3)},
            drafts=build_draft_tokens(requests, V, CPU),
        )
        return Sampler()(rows, md).sampled_token_ids[start : start + 3]

    a = run([([2], None)], 0)
    b = run([([0, 3, 5], torch.full((3, V), 1 / V)), ([], None)], 2)
    assert torch.equal(a, b)


def test_greedy_rows_take_the_argmax_whatever_the_draft_probs():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(6, V, generator=gen)
    q = torch.rand(2, V, generator=gen)
    q = q / q.sum(-1, keepdim=True)
    # Request 0 (greedy): drafts [argmax of row 0, something else]; request 1 random.
    greedy_draft = [int(logits[0].argmax()), (int(logits[1].argmax()) + 1) % V]
    drafts = build_draft_tokens([(greedy_draft, q), ([1, 2], None)], V, CPU)
    md = SamplingMetadata(
        temperature=torch.tensor([0.0, 0, 0, 1, 1, 1]),
        all_greedy=False,
        all_random=False,
        default_generator=gen,
        drafts=drafts,
    )
    tokens = Sampler()(logits, md).sampled_token_ids
    assert torch.equal(tokens[:3], logits[:3].argmax(-1))


def test_build_draft_tokens_lays_out_rows():
    q = torch.full((2, V), 1 / V)
    d = build_draft_tokens([([3, 1], q), ([], None), ([4], None)], V, CPU)
    assert d.token_ids.tolist() == [3, 1, -1, -1, 4, -1]
    assert d.probs is not None
    expected = torch.zeros(6, V)
    expected[:2] = q
    expected[4, 4] = 1.0  # a request without probs, batched with one that has them
    assert torch.equal(d.probs, expected)
    assert build_draft_tokens([([3], None)], V, CPU).probs is None
