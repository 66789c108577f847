"""Sampler and sampling-metadata tests against independent float64 references.

Distribution tests replicate one row tens of thousands of times in a single forward call and
compare the token counts with a float64 numpy reference of the target distribution, built by
walking a Python-sorted token list (the sampler uses per-row logit thresholds instead).
``test_distribution_check_rejects_plausible_bugs`` shows the check has the power to catch the
mistakes it is meant to catch. Every random draw uses a fixed seed, so the tests are
deterministic; the bounds are set so that a correct sampler would fail a check with any other
seed with probability of order 1e-6.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np
import pytest
import torch

from hitchllm.engine.sampler import Sampler, apply_penalties, greedy_tokens
from hitchllm.engine.sampling_metadata import SamplingMetadata, build_sampling_metadata
from hitchllm.sampling_params import SamplingParams

# Distinct logits in no particular order, so index order differs from rank order.
LOGITS = np.array([0.3, 2.0, -0.9, 1.1, -2.2, 0.7, -0.4, 1.5, 0.0, -1.5])
NUM_SAMPLES = 40_000

# name -> (temperature, top_k, top_p, min_p); each filter bites (removes tokens) in its case.
CASES = {
    "temperature": (0.6, 0, 1.0, 0.0),
    "top_k": (1.5, 4, 1.0, 0.0),
    "top_p": (1.0, 0, 0.75, 0.0),
    "min_p": (1.0, 0, 1.0, 0.2),
    "top_k_top_p": (0.9, 6, 0.87, 0.0),
    "top_k_top_p_min_p": (1.3, 7, 0.9, 0.25),
}


# ---------------------------------------------------------------------------------------------
# Independent float64 reference and the statistical check
# ---------------------------------------------------------------------------------------------


def _renormalized(z: np.ndarray, keep: set[int]) -> np.ndarray:
    m = max(z[i] for i in keep)
    p = np.zeros(len(z))
    for i in keep:
        p[i] = math.exp(z[i] - m)
    return p / p.sum()


def _top_p_set(
    z: np.ndarray, order: list[int], keep: set[int], top_p: float, gaps: list[float] | None = None
) -> set[int]:
    p = _renormalized(z, keep)
    chosen: set[int] = set()
    mass = 0.0
    for i in order:
        if i in keep:
            chosen.add(i)
            mass += p[i]
            if gaps is not None:
                gaps.append(abs(mass - top_p))
            if mass >= top_p:
                break
    return chosen


def _min_p_set(
    z: np.ndarray, keep: set[int], min_p: float, gaps: list[float] | None = None
) -> set[int]:
    p = _renormalized(z, keep)
    if gaps is not None:
        gaps += [abs(p[i] / p.max() - min_p) for i in keep]
    return {i for i in keep if p[i] >= min_p * p.max()}


def reference_probs(
    logits: np.ndarray,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    gaps: list[float] | None = None,
) -> np.ndarray:
    """Target distribution: temperature, then top-k, top-p, min-p, each on the renormalized
    survivors of the previous step, by explicit walks over a sorted token list.

    ``gaps`` collects how far each cumulative mass / probability ratio lies from its cut-off,
    so a case can check that float32 rounding cannot move a token across a boundary.
    """
    z = np.asarray(logits, dtype=np.float64) / temperature
    order = sorted(range(len(z)), key=lambda i: z[i], reverse=True)
    keep = set(order[:top_k]) if top_k else set(order)
    if top_p < 1.0:
        keep = _top_p_set(z, order, keep, top_p, gaps)
    if min_p > 0.0:
        keep = _min_p_set(z, keep, min_p, gaps)
    return _renormalized(z, keep)


def chi2_critical(df: int, z: float = 4.753) -> float:
    """Upper chi-square quantile (z = 4.753 gives p = 1e-6) by the Wilson-Hilferty formula."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def distribution_mismatch(counts: np.ndarray, probs: np.ndarray) -> str | None:
    """Why ``counts`` could not come from ``probs``, or None if they plausibly could.

    Fails on any count outside the support, a chi-square statistic above its 1e-6 quantile,
    or a total-variation distance above 0.02 (a correct sampler at n = 40k sits near 0.005).
    """
    n = counts.sum()
    outside = counts[probs == 0].sum()
    if outside:
        return f"{outside} samples outside the support {np.flatnonzero(probs).tolist()}"
    support = probs > 0
    expected = n * probs[support]
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    if df > 0 and stat > chi2_critical(df):
        return f"chi-square {stat:.1f} > {chi2_critical(df):.1f} (df={df})"
    tv = 0.5 * float(np.abs(counts / n - probs).sum())
    if tv > 0.02:
        return f"total variation {tv:.4f} > 0.02"
    return None


# ---------------------------------------------------------------------------------------------
# Helpers to run the sampler
# ---------------------------------------------------------------------------------------------


def build(
    params: list[SamplingParams],
    *,
    vocab_size: int,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    eos: list[int | None] | None = None,
    generators: list[torch.Generator | None] | None = None,
    default_generator: torch.Generator | None = None,
) -> SamplingMetadata:
    n = len(params)
    return build_sampling_metadata(
        params,
        prompt_token_ids=prompts if prompts is not None else [[]] * n,
        output_token_ids=outputs if outputs is not None else [[]] * n,
        eos_token_ids=eos if eos is not None else [None] * n,
        generators=generators if generators is not None else [None] * n,
        default_generator=default_generator,
        vocab_size=vocab_size,
        device=torch.device("cpu"),
    )


def sample_counts(
    logits: np.ndarray, params: SamplingParams, n: int = NUM_SAMPLES, seed: int = 0, **kw
) -> np.ndarray:
    """Token counts of ``n`` copies of one row sampled in a single forward call."""
    row = torch.tensor(logits, dtype=torch.float32)
    metadata = build(
        [params] * n,
        vocab_size=len(logits),
        default_generator=torch.Generator().manual_seed(seed),
        **kw,
    )
    tokens = Sampler()(row.expand(n, -1), metadata).sampled_token_ids
    return np.bincount(tokens.numpy(), minlength=len(logits))


@functools.cache
def case_counts(name: str) -> np.ndarray:
    temperature, top_k, top_p, min_p = CASES[name]
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    return sample_counts(LOGITS, params, seed=list(CASES).index(name))


# ---------------------------------------------------------------------------------------------
# Random sampling matches the target distribution
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_sampled_distribution_matches_float64_reference(name: str) -> None:
    """Empirical token frequencies match the float64 reference; filtered tokens never occur."""
    temperature, top_k, top_p, min_p = CASES[name]
    gaps: list[float] = []
    probs = reference_probs(LOGITS, temperature, top_k, top_p, min_p, gaps)
    assert min(gaps, default=1.0) > 1e-3, "case too close to a cut-off to be unambiguous"
    mismatch = distribution_mismatch(case_counts(name), probs)
    assert mismatch is None, f"{name}: {mismatch}"


def _top_p_exclusive(logits: np.ndarray, t: float, k: int, p: float, mp: float) -> np.ndarray:
    # Bug: stops before the token that makes the mass reach top_p.
    z = logits / t
    order = sorted(range(len(z)), key=lambda i: z[i], reverse=True)
    probs = _renormalized(z, set(order))
    keep, mass = set(), 0.0
    for i in order:
        mass += probs[i]
        if mass >= p:
            break
        keep.add(i)
    return _renormalized(z, keep or {order[0]})


def _top_p_before_top_k_renorm(
    logits: np.ndarray, t: float, k: int, p: float, mp: float
) -> np.ndarray:
    # Bug: top-p measures mass on the full distribution instead of the top-k survivors.
    z = logits / t
    order = sorted(range(len(z)), key=lambda i: z[i], reverse=True)
    keep = _top_p_set(z, order, set(order), p) & set(order[:k])
    return _renormalized(z, keep)


def _min_p_before_top_p(logits: np.ndarray, t: float, k: int, p: float, mp: float) -> np.ndarray:
    # Bug: min-p runs before top-p, so top-p sees a renormalized, smaller set.
    z = logits / t
    order = sorted(range(len(z)), key=lambda i: z[i], reverse=True)
    keep = _min_p_set(z, set(order[:k]), mp)
    return _renormalized(z, _top_p_set(z, order, keep, p))


def _min_p_absolute(logits: np.ndarray, t: float, k: int, p: float, mp: float) -> np.ndarray:
    # Bug: compares probabilities with min_p itself instead of min_p * max probability.
    z = logits / t
    probs = _renormalized(z, set(range(len(z))))
    return _renormalized(z, {i for i in range(len(z)) if probs[i] >= mp})


BUGS = [
    (
        "temperature",
        "temperature ignored",
        lambda lg, t, k, p, mp: reference_probs(lg, 1.0, k, p, mp),
    ),
    (
        "temperature",
        "logits times temperature",
        lambda lg, t, k, p, mp: reference_probs(lg, 1.0 / t, k, p, mp),
    ),
    ("top_k", "top-k keeps k+1", lambda lg, t, k, p, mp: reference_probs(lg, t, k + 1, p, mp)),
    ("top_k", "top-k keeps k-1", lambda lg, t, k, p, mp: reference_probs(lg, t, k - 1, p, mp)),
    (
        "top_k",
        "temperature ignored with top-k",
        lambda lg, t, k, p, mp: reference_probs(lg, 1.0, k, p, mp),
    ),
    ("top_p", "top-p drops the crossing token", _top_p_exclusive),
    ("top_k_top_p", "top-p on the un-renormalized distribution", _top_p_before_top_k_renorm),
    ("top_k_top_p_min_p", "min-p before top-p", _min_p_before_top_p),
    ("min_p", "min-p not relative to the max", _min_p_absolute),
]


@pytest.mark.parametrize(("name", "bug", "wrong_reference"), BUGS, ids=[b[1] for b in BUGS])
def test_distribution_check_rejects_plausible_bugs(
    name: str, bug: str, wrong_reference: Callable[..., np.ndarray]
) -> None:
    """The check used above fails when the samples are compared with a plausibly wrong target,
    so the distribution tests would catch a sampler implementing that wrong target."""
    temperature, top_k, top_p, min_p = CASES[name]
    wrong = wrong_reference(LOGITS, temperature, top_k, top_p, min_p)
    assert distribution_mismatch(case_counts(name), wrong) is not None, bug


def test_seeded_rows_follow_the_target_distribution() -> None:
    """Noise drawn from per-row generators (one seed per row) also yields the target."""
    n = 5_000
    temperature, top_k, top_p, min_p = CASES["top_k_top_p_min_p"]
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=1)
    generators = [torch.Generator().manual_seed(1000 + i) for i in range(n)]
    counts = sample_counts(LOGITS, params, n=n, generators=generators)
    probs = reference_probs(LOGITS, temperature, top_k, top_p, min_p)
    # Support and chi-square only: at n = 5k the 0.02 TV bound would be too tight.
    assert counts[probs == 0].sum() == 0
    expected = n * probs[probs > 0]
    stat = ((counts[probs > 0] - expected) ** 2 / expected).sum()
    assert stat < chi2_critical(int((probs > 0).sum()) - 1)


def test_ties_at_the_top_k_boundary_are_all_kept() -> None:
    """Documented tie rule: tokens tied with the k-th largest logit survive top-k."""
    logits = np.array([3.0, 2.0, 2.0, 0.0, -1.0])
    counts = sample_counts(logits, SamplingParams(top_k=2))
    probs = _renormalized(logits, {0, 1, 2})
    assert distribution_mismatch(counts, probs) is None


def test_top_p_always_keeps_the_top_token() -> None:
    """A top_p smaller than the top token's probability still samples the top token."""
    counts = sample_counts(LOGITS, SamplingParams(top_p=0.01), n=1000)
    assert counts[int(np.argmax(LOGITS))] == 1000


def test_global_rng_path_is_reproducible_under_manual_seed() -> None:
    """Without a default generator, noise comes from torch's global RNG."""
    logits = torch.tensor(LOGITS, dtype=torch.float32).expand(64, -1)
    metadata = build([SamplingParams()] * 64, vocab_size=len(LOGITS))
    torch.manual_seed(7)
    first = Sampler()(logits, metadata).sampled_token_ids
    torch.manual_seed(7)
    second = Sampler()(logits, metadata).sampled_token_ids
    assert torch.equal(first, second)
    assert len(set(first.tolist())) > 1


# ---------------------------------------------------------------------------------------------
# Greedy rows
# ---------------------------------------------------------------------------------------------


def test_greedy_is_argmax_and_ignores_filters() -> None:
    """Greedy rows return numpy's argmax (first index on ties), whatever their filters say."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(16, 100)).astype(np.float32)
    logits[3, [10, 40]] = 9.0  # a tie: the lower id wins
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.5)] * 16
    metadata = build(params, vocab_size=100)
    assert metadata.all_greedy and metadata.top_k is None
    tokens = Sampler()(torch.from_numpy(logits), metadata).sampled_token_ids
    np.testing.assert_array_equal(tokens.numpy(), logits.argmax(axis=1))
    assert tokens[3] == 10


@pytest.mark.parametrize("threads", [1, 2])
def test_greedy_tokens_are_the_first_index_of_the_maximum(threads: int) -> None:
    """Against numpy's argmax (first occurrence; a NaN counts as the maximum) on rows full of
    ties, with NaN, inf and all -inf rows, odd widths and one long row."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for width in (1, 7, 4096, 4097, 100_003):
        x = torch.randint(-3, 4, (2 if width > 5000 else 64, width), generator=generator).float()
        rows.append(x)
    special = torch.randint(-3, 4, (64, 4096), generator=generator).float()
    special[3, 100] = special[3, 50] = float("nan")
    special[5, 7] = special[5, 3000] = float("inf")
    special[9] = float("-inf")
    special[11, 17] = float("nan")
    special[11, 4] = float("inf")
    rows.append(special)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for x in rows:
            assert np.array_equal(greedy_tokens(x).numpy(), np.argmax(x.double().numpy(), axis=-1))
    finally:
        torch.set_num_threads(before)


def test_greedy_rows_unaffected_by_random_rows_in_the_batch() -> None:
    """Mixing random rows (with filters) into a batch does not change the greedy rows."""
    rng = np.random.default_rng(1)
    logits = torch.from_numpy(rng.normal(size=(12, 50)).astype(np.float32))
    greedy = SamplingParams(temperature=0.0)
    random = SamplingParams(temperature=1.5, top_k=5, top_p=0.9, min_p=0.05)
    params = [greedy if i % 3 == 0 else random for i in range(12)]
    metadata = build(params, vocab_size=50, default_generator=torch.Generator().manual_seed(0))
    assert not metadata.all_greedy and not metadata.all_random
    tokens = Sampler()(logits, metadata).sampled_token_ids
    greedy_rows = [i for i in range(12) if i % 3 == 0]
    expected = logits.numpy().argmax(axis=1)
    np.testing.assert_array_equal(tokens.numpy()[greedy_rows], expected[greedy_rows])
    # Random rows stay inside their top-5.
    for i in set(range(12)) - set(greedy_rows):
        assert tokens[i].item() in np.argsort(-logits[i].numpy())[:5]


def test_temperature_below_epsilon_is_greedy() -> None:
    metadata = build([SamplingParams(temperature=1e-6)], vocab_size=4)
    assert metadata.all_greedy and metadata.temperature.tolist() == [0.0]


def test_forward_does_not_modify_the_logits() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5]])
    before = logits.clone()
    params = [SamplingParams(top_k=2, repetition_penalty=2.0, min_tokens=1, logprobs=1)]
    metadata = build(params, vocab_size=4, prompts=[[2]], eos=[2])
    Sampler()(logits, metadata)
    assert torch.equal(logits, before)


# ---------------------------------------------------------------------------------------------
# Seeded rows
# ---------------------------------------------------------------------------------------------


def _seeded_tokens(
    logits: torch.Tensor,
    batch: list[tuple[int, SamplingParams, int | None]],
    row: int,
    steps: int,
    default_seed: int,
) -> list[int]:
    """Tokens of ``batch[row]`` over ``steps`` calls; batch items are (logit row, params, seed)."""
    generators = [None if s is None else torch.Generator().manual_seed(s) for _, _, s in batch]
    default = torch.Generator().manual_seed(default_seed)
    rows = logits[[b[0] for b in batch]]
    prompts = [[1, 2, 3]] * len(batch)
    metadata = build(
        [b[1] for b in batch],
        vocab_size=logits.shape[1],
        prompts=prompts,
        generators=generators,
        default_generator=default,
    )
    sampler = Sampler()
    return [int(sampler(rows, metadata).sampled_token_ids[row]) for _ in range(steps)]


def test_seeded_row_is_reproducible_and_independent_of_batch() -> None:
    """Same seed, same logits -> same token sequence, whatever the row's position, its
    neighbours (greedy, random, seeded, filtered, penalized) and the default generator."""
    logits = torch.from_numpy(np.random.default_rng(2).normal(size=(4, 30)).astype(np.float32))
    seeded = SamplingParams(temperature=1.2, seed=42)
    batch_a = [
        (0, seeded, 42),
        (1, SamplingParams(), None),
        (2, SamplingParams(temperature=0), None),
    ]
    batch_b = [
        (3, SamplingParams(top_k=5, top_p=0.8, min_p=0.1, repetition_penalty=1.3), None),
        (2, SamplingParams(temperature=0.7, seed=5, presence_penalty=0.5), 5),
        (0, seeded, 42),
        (1, SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[4]), None),
    ]
    a = _seeded_tokens(logits, batch_a, row=0, steps=25, default_seed=0)
    assert a == _seeded_tokens(logits, batch_a, row=0, steps=25, default_seed=0)
    assert a == _seeded_tokens(logits, batch_b, row=2, steps=25, default_seed=123)
    assert len(set(a)) > 3, "the sequence must actually be random for the test to mean much"
    other_seed = [(0, SamplingParams(temperature=1.2, seed=43), 43)]
    assert a != _seeded_tokens(logits, other_seed, row=0, steps=25, default_seed=0)


# ---------------------------------------------------------------------------------------------
# Penalties and min_tokens
# ---------------------------------------------------------------------------------------------


def _penalize_reference(
    logits: np.ndarray,
    prompt: list[int],
    output: list[int],
    presence: float,
    frequency: float,
    repetition: float,
) -> np.ndarray:
    out = np.array(logits, dtype=np.float64)
    for t in range(len(out)):
        if t in prompt or t in output:
            out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
        count = output.count(t)
        out[t] -= frequency * count + presence * (count > 0)
    return out


def test_penalties_match_hand_computed_values() -> None:
    """Repetition (prompt or output), then frequency and presence (output only).

    token 0: prompt, 2.0 / 2 = 1.0;  token 1: unseen, -1.0;
    token 2: output twice, 0.5 / 2 - 0.5 * 2 - 0.25 = -1.0;  token 3: prompt, -0.5 * 2 = -1.0;
    token 4: output once, 1.0 / 2 - 0.5 - 0.25 = -0.25;  token 5: unseen, 0.0.
    Row 1 has no penalties and keeps its logits although a neighbour uses them.
    """
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0, 0.0]] * 2)
    params = [
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(),
    ]
    m = build(params, vocab_size=6, prompts=[[0, 3], [0, 1, 2]], outputs=[[2, 2, 4], [4]])
    assert m.prompt_token_ids is not None and m.output_token_ids is not None
    assert m.presence_penalty is not None and m.frequency_penalty is not None
    assert m.repetition_penalty is not None
    out = apply_penalties(
        logits,
        m.prompt_token_ids,
        m.output_token_ids,
        m.presence_penalty,
        m.frequency_penalty,
        m.repetition_penalty,
    )
    expected = [[1.0, -1.0, -1.0, -1.0, -0.25, 0.0], [2.0, -1.0, 0.5, -0.5, 1.0, 0.0]]
    np.testing.assert_allclose(out.numpy(), expected, atol=1e-6)


def test_penalties_match_reference_on_random_rows() -> None:
    """Ragged prompts/outputs with repeats, negative penalties included, match a loop reference."""
    rng = np.random.default_rng(3)
    vocab = 40
    logits = rng.normal(size=(6, vocab)) * 2
    prompts = [rng.integers(0, vocab, size=rng.integers(0, 15)).tolist() for _ in range(6)]
    outputs = [rng.integers(0, vocab, size=rng.integers(0, 25)).tolist() for _ in range(6)]
    pens = [(rng.uniform(-2, 2), rng.uniform(-2, 2), rng.uniform(0.5, 2.0)) for _ in range(6)]
    params = [
        SamplingParams(presence_penalty=p, frequency_penalty=f, repetition_penalty=r)
        for p, f, r in pens
    ]
    m = build(params, vocab_size=vocab, prompts=prompts, outputs=outputs)
    assert m.prompt_token_ids is not None and m.output_token_ids is not None
    assert m.presence_penalty is not None and m.frequency_penalty is not None
    assert m.repetition_penalty is not None
    out = apply_penalties(
        torch.tensor(logits, dtype=torch.float32),
        m.prompt_token_ids,
        m.output_token_ids,
        m.presence_penalty,
        m.frequency_penalty,
        m.repetition_penalty,
    )
    for i, (p, f, r) in enumerate(pens):
        ref = _penalize_reference(logits[i], prompts[i], outputs[i], p, f, r)
        np.testing.assert_allclose(out[i].numpy(), ref, rtol=1e-5, atol=1e-5)


def test_penalties_apply_before_temperature_in_sampling() -> None:
    """Sampling with penalties and temperature follows softmax(penalized / T)."""
    params = SamplingParams(
        temperature=0.8, repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3
    )
    prompt, output = [1, 4], [7, 7, 3, 0]
    counts = sample_counts(
        LOGITS, params, prompts=[prompt] * NUM_SAMPLES, outputs=[output] * NUM_SAMPLES
    )
    penalized = _penalize_reference(LOGITS, prompt, output, 0.3, 0.4, 1.5)
    assert distribution_mismatch(counts, reference_probs(penalized, 0.8, 0, 1.0, 0.0)) is None
    # Forgetting the penalties would be caught.
    assert distribution_mismatch(counts, reference_probs(LOGITS, 0.8, 0, 1.0, 0.0)) is not None


def test_min_tokens_forbids_stop_and_eos_until_reached() -> None:
    """Under min_tokens, stop_token_ids and EOS are forbidden; with ignore_eos only the stop
    ids are; once the output is long enough nothing is."""
    eos, stop = 5, 3
    # Preference order: eos (5), stop (3), then 1.
    logits = torch.tensor([[0.0, 2.0, 0.0, 3.0, 0.0, 4.0, 0.0, 0.0]] * 4)
    under = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[stop])
    ignore = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[stop], ignore_eos=True)
    params = [under, under, ignore, ignore]
    outputs = [[9], [9, 9], [], [9, 9]]
    m = build(params, vocab_size=8, outputs=outputs, eos=[eos] * 4)
    tokens = Sampler()(logits, m).sampled_token_ids.tolist()
    assert tokens == [1, eos, eos, eos]
    logits[2, eos] = -10.0  # with EOS out of the way, the stop id is still forbidden
    assert Sampler()(logits, m).sampled_token_ids[2] == 1


def test_min_tokens_random_rows_renormalize_over_allowed_tokens() -> None:
    """Forbidden ids never get sampled; the rest keep their relative probabilities."""
    params = SamplingParams(min_tokens=4, stop_token_ids=[7, 3])
    counts = sample_counts(LOGITS, params, outputs=[[0]] * NUM_SAMPLES, eos=[1] * NUM_SAMPLES)
    allowed = set(range(len(LOGITS))) - {1, 3, 7}
    assert distribution_mismatch(counts, _renormalized(LOGITS, allowed)) is None


# ---------------------------------------------------------------------------------------------
# Logprobs
# ---------------------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_ranks_and_top_ids() -> None:
    """Logprobs describe the unprocessed logits (not temperature/penalties/filters): column 0 is
    the sampled token, then the top-k ids in order; ranks are 1-based under that distribution."""
    rng = np.random.default_rng(4)
    vocab, k = 30, 5
    logits = rng.normal(size=(8, vocab)) * 3
    params = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=2.0, top_k=20, logprobs=k),
        SamplingParams(temperature=0.5, repetition_penalty=1.8, logprobs=0),
        SamplingParams(top_p=0.5, min_p=0.1),
    ] * 2
    m = build(
        params,
        vocab_size=vocab,
        prompts=[[0, 1, 2]] * 8,
        default_generator=torch.Generator().manual_seed(0),
    )
    assert m.max_num_logprobs == k
    out = Sampler()(torch.tensor(logits, dtype=torch.float32), m)
    assert out.logprobs is not None
    ids, lps, ranks = out.logprobs.token_ids, out.logprobs.logprobs, out.logprobs.ranks
    assert ids.shape == (8, k + 1) and lps.shape == (8, k + 1) and ranks.shape == (8,)
    assert lps.dtype == torch.float32 and ids.dtype == torch.int64
    ref = logits - logits.max(axis=1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(axis=1, keepdims=True))
    sampled = out.sampled_token_ids.numpy()
    for i in range(8):
        order = np.argsort(-ref[i])
        assert ids[i, 0] == sampled[i]
        np.testing.assert_allclose(lps[i, 0], ref[i, sampled[i]], atol=1e-5)
        np.testing.assert_array_equal(ids[i, 1:].numpy(), order[:k])
        np.testing.assert_allclose(lps[i, 1:].numpy(), ref[i, order[:k]], atol=1e-5)
        assert ranks[i] == 1 + int((ref[i] > ref[i, sampled[i]]).sum())
    assert ranks[0] == 1  # greedy with no penalties takes the top token


def test_no_logprobs_requested_returns_none() -> None:
    m = build([SamplingParams(temperature=0)], vocab_size=4)
    assert m.max_num_logprobs is None
    assert Sampler()(torch.zeros(1, 4), m).logprobs is None


def test_logprobs_zero_returns_only_the_sampled_token() -> None:
    m = build([SamplingParams(temperature=0, logprobs=0)], vocab_size=4)
    out = Sampler()(torch.tensor([[0.0, 1.0, 3.0, 2.0]]), m)
    assert out.logprobs is not None
    assert out.logprobs.token_ids.tolist() == [[2]]


# ---------------------------------------------------------------------------------------------
# Metadata builder
# ---------------------------------------------------------------------------------------------


def test_builder_leaves_unused_features_as_none() -> None:
    """Default params produce no optional tensors, so the sampler skips that work entirely."""
    m = build(
        [SamplingParams(), SamplingParams(top_k=50)],
        vocab_size=50,
        outputs=[[1, 2], [3]],
        eos=[0, 0],
    )
    assert m.all_random and not m.all_greedy
    assert m.top_k is None  # top_k >= vocab size keeps everything
    assert m.top_p is None and m.min_p is None
    assert m.no_penalties and m.prompt_token_ids is None and m.output_token_ids is None
    assert m.stop_token_mask_rows is None and m.max_num_logprobs is None
    assert m.generators == {}


def test_builder_pads_with_vocab_size_and_tracks_seeded_rows() -> None:
    g = torch.Generator().manual_seed(0)
    params = [
        SamplingParams(temperature=0, seed=1, min_tokens=2, stop_token_ids=[4, 5]),
        SamplingParams(seed=2, frequency_penalty=1.0),
        SamplingParams(top_p=0.9),
    ]
    m = build(
        params,
        vocab_size=10,
        prompts=[[1], [2, 3, 4], [5]],
        outputs=[[], [6], []],
        eos=[9, 9, None],
        generators=[g, g, None],
    )
    assert m.temperature.tolist() == [0.0, 1.0, 1.0]
    assert set(m.generators) == {1}  # greedy rows draw no noise
    assert m.stop_token_mask_rows is not None and m.prompt_token_ids is not None
    assert m.stop_token_mask_rows.tolist() == [[4, 5, 9], [10, 10, 10], [10, 10, 10]]
    # Only the penalized row contributes tokens.
    assert m.prompt_token_ids.tolist() == [[10, 10, 10], [2, 3, 4], [10, 10, 10]]
    assert m.top_p is not None and m.top_p.tolist() == pytest.approx([1.0, 1.0, 0.9])


def test_builder_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="one prompt, output"):
        build_sampling_metadata(
            [SamplingParams()], [[]], [], [None], [None], None, 4, torch.device("cpu")
        )


# ---------------------------------------------------------------------------------------------
# No host-device sync (needs CUDA)
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_forward_never_synchronizes_with_the_host() -> None:
    """With every feature on, forward runs under CUDA's sync-debug mode set to error."""
    device = torch.device("cuda")
    vocab = 64
    params = [
        SamplingParams(temperature=0, logprobs=3, min_tokens=5, stop_token_ids=[1]),
        SamplingParams(temperature=0.8, top_k=8, top_p=0.9, min_p=0.05, seed=3),
        SamplingParams(temperature=1.1, repetition_penalty=1.2, presence_penalty=0.5),
    ]
    metadata = build_sampling_metadata(
        params,
        prompt_token_ids=[[1, 2], [3], [4, 5, 6]],
        output_token_ids=[[7], [8, 8], []],
        eos_token_ids=[0, 0, 0],
        generators=[None, torch.Generator(device=device).manual_seed(3), None],
        default_generator=torch.Generator(device=device).manual_seed(0),
        vocab_size=vocab,
        device=device,
    )
    logits = torch.randn(3, vocab, device=device, dtype=torch.bfloat16)
    sampler = Sampler()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sampler(logits, metadata)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.sampled_token_ids.shape == (3,)
    assert out.sampled_token_ids[0].item() != 1
