"""The one-pass temperature sampling kernel (``hitchllm.engine.race_kernel``): greedy rows and
ties on the CPU in Triton's interpreter, the sampled distribution against the float64 reference
on the GPU (the interpreter takes ~25 ms a row, too slow for tens of thousands of samples)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_sampler import CASES, LOGITS, NUM_SAMPLES, distribution_mismatch, reference_probs

from hitchllm.engine import sampler as sampler_module
from hitchllm.engine.race_kernel import _race_kernel, race_sample
from hitchllm.engine.sampler import Sampler
from hitchllm.engine.sampling_metadata import build_sampling_metadata
from hitchllm.sampling_params import SamplingParams


def test_greedy_rows_are_the_argmax_with_ties_to_the_lowest_id():
    """Three chunks of 8,192 ids: the maximum in the last chunk, ties within and across
    chunks, a row of -inf (id 0, as torch.argmax), bfloat16 logits read as they are."""
    vocab = 20_000
    logits = torch.randn(5, vocab).to(torch.bfloat16)
    logits[0, 19_999] = 9.0
    logits[1, [3_000, 9_000, 17_000]] = 9.0
    logits[2, [8_191, 8_192]] = 9.0
    logits[3] = float("-inf")
    logits[4, [5, 6]] = 9.0
    out = race_sample(logits, torch.zeros(5), torch.Generator().manual_seed(0))
    assert out.tolist() == logits.float().argmax(dim=1).tolist() == [19_999, 3_000, 8_191, 0, 5]
    assert out.dtype == torch.int64


def test_noise_differs_by_row_repeats_by_seed_and_never_picks_minus_inf():
    vocab = 64
    logits = torch.zeros(48, vocab)
    logits[:, 1::2] = float("-inf")
    temperature = torch.full((48,), 0.7)
    first = race_sample(logits, temperature, torch.Generator().manual_seed(5))
    again = race_sample(logits, temperature, torch.Generator().manual_seed(5))
    other = race_sample(logits, temperature, torch.Generator().manual_seed(6))
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert (first % 2 == 0).all()  # only the finite (even) ids
    assert len(set(first.tolist())) > 10  # 48 rows of 32 equal tokens: each row its own noise


def _race_scores(logit: float, temperature: float, rows: int, ids: int = 1) -> torch.Tensor:
    """Each row's best score when its first ``ids`` ids have ``logit`` and the rest of its 64
    are -inf (seed 7: a row keeps its noise from call to call)."""
    logits = torch.full((rows, 64), float("-inf"))
    logits[:, :ids] = logit
    scores = torch.empty(rows, 1)
    _race_kernel[(rows, 1)](logits, logits.stride(0), torch.full((rows,), temperature),
                            torch.tensor([7]), scores, torch.empty(rows, 1, dtype=torch.int32),
                            64, 1, CHUNK=64, BLOCK=16, FAST_LOG2=False)
    return scores.squeeze(1).double()


def test_scores_are_the_race_in_base_2():
    """Score = logit * log2(e) / T - log2(q), q = -ln(u) exponential: the same noise under two
    temperatures differs by the scaled logit; with 64 ids of logit 0 a row's best score is
    -log2 of the least of 64 exponentials, whose mean is 1/64 (a natural-log score would give
    2^-score a mean of about 0.0032)."""
    base = _race_scores(0.0, 1.0, 100)
    hot = _race_scores(3.0, 0.5, 100)
    torch.testing.assert_close(hot - base, torch.full_like(base, 6 / np.log(2)), atol=1e-4,
                               rtol=0)
    least = torch.exp2(-_race_scores(0.0, 1.0, 300, ids=64))
    assert abs(least.mean().item() - 1 / 64) < 5 / 64 / np.sqrt(300)


def _plain(n: int, temperature: float, device: torch.device):
    return build_sampling_metadata(
        [SamplingParams(temperature=temperature)] * n, prompt_token_ids=[[]] * n,
        output_token_ids=[[]] * n, eos_token_ids=[None] * n, generators=[None] * n,
        default_generator=torch.Generator(device=device).manual_seed(0), vocab_size=len(LOGITS),
        device=device)


def test_the_sampler_takes_the_kernel_only_on_cuda_for_plain_temperature(monkeypatch):
    calls = []
    monkeypatch.setattr(sampler_module, "_plain_temperature",
                        lambda m: calls.append(m) or False)
    Sampler()(torch.tensor(LOGITS, dtype=torch.float32).expand(3, -1),
              _plain(3, 0.6, torch.device("cpu")))
    assert calls == []  # the CPU never asks
    monkeypatch.undo()
    metadata = _plain(3, 0.6, torch.device("cpu"))
    assert sampler_module._plain_temperature(metadata)
    for params in (SamplingParams(temperature=0.6, top_k=3), SamplingParams(temperature=0.6,
                   logprobs=1), SamplingParams(temperature=0.6, presence_penalty=0.5),
                   SamplingParams(temperature=0)):
        m = build_sampling_metadata([params], [[1]], [[]], [None], [None], None, len(LOGITS),
                                    torch.device("cpu"))
        assert not sampler_module._plain_temperature(m), params
    seeded = build_sampling_metadata([SamplingParams(temperature=0.6, seed=1)], [[1]], [[]],
                                     [None], [torch.Generator().manual_seed(1)], None,
                                     len(LOGITS), torch.device("cpu"))
    assert not sampler_module._plain_temperature(seeded)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_kernel_samples_the_target_distribution_on_cuda():
    device = torch.device("cuda")
    temperature = CASES["temperature"][0]
    metadata = _plain(NUM_SAMPLES, temperature, device)
    assert sampler_module._plain_temperature(metadata)
    row = torch.tensor(LOGITS, dtype=torch.float32, device=device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = Sampler()(row.expand(NUM_SAMPLES, -1), metadata).sampled_token_ids
    finally:
        torch.cuda.set_sync_debug_mode("default")
    counts = np.bincount(tokens.cpu().numpy(), minlength=len(LOGITS))
    assert distribution_mismatch(counts, reference_probs(LOGITS, temperature, 0, 1.0, 0.0)) \
        is None
    # The check has the power to see a wrong temperature.
    assert distribution_mismatch(counts, reference_probs(LOGITS, 1.0, 0, 1.0, 0.0)) is not None
    # A large vocabulary (several chunks per row) in bfloat16: the winner's frequency.
    vocab = 151_936
    logits = torch.full((NUM_SAMPLES, vocab), -4.0, device=device, dtype=torch.bfloat16)
    logits[:, 150_000] = 4.0
    picked = race_sample(logits, torch.ones(NUM_SAMPLES, device=device), None)
    p = np.exp(4.0) / (np.exp(4.0) + (vocab - 1) * np.exp(-4.0))
    share = (picked == 150_000).float().mean().item()
    assert abs(share - p) < 5 * np.sqrt(p * (1 - p) / NUM_SAMPLES)
