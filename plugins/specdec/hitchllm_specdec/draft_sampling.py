"""Sampling drafts the way the target samples its tokens, so that the draft distribution q
is as close to the target's p as the draft model allows.

Each request's drafts follow its own ``SamplingParams``: greedy requests (temperature 0)
take the argmax and report no probabilities (a deterministic draft is verified as a point
mass); the others divide by their temperature, apply top-k / top-p / min-p with the core
sampler's filter (``apply_top_k_top_p_min_p``) and draw with the exponential race, reporting
the distribution they drew from. Penalties and logits processors (grammars, logit bias) are
not applied to drafts: the rejection sampler keeps the output exact whatever q is, so they
only cost acceptance. Seeded requests draw their noise from their own generator, so a seeded
request's drafts, and therefore its output, repeat from run to run.
"""

from __future__ import annotations

import torch

from hitchllm.engine.sampler import apply_top_k_top_p_min_p
from hitchllm.logits_processor import host_to_device
from hitchllm.sampling_params import SamplingParams


class DraftSampling:
    """The sampling parameters of one proposal's rows (row order of the batch); the draft
    steps sample rows ``0..n-1`` (the requests still drafting are always a prefix)."""

    def __init__(
        self, params: list[SamplingParams | None], generators: list[torch.Generator | None],
        default_generator: torch.Generator, vocab_size: int, device: torch.device,
    ) -> None:
        self.vocab_size = vocab_size
        self.greedy = [p is None or p.greedy for p in params]
        self.all_greedy = all(self.greedy)
        self.generators = {i: g for i, g in enumerate(generators)
                           if g is not None and not self.greedy[i]}
        self.default_generator = default_generator
        if self.all_greedy:
            return
        randoms = [(p if p is not None and not g else SamplingParams())
                   for p, g in zip(params, self.greedy, strict=True)]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return host_to_device(torch.tensor(values, dtype=dtype), device)

        self.greedy_mask = tensor(self.greedy, torch.bool)
        self.temperature = tensor([1.0 if g else p.temperature
                                   for p, g in zip(randoms, self.greedy, strict=True)],
                                  torch.float32)
        top_k = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in randoms]
        self.top_k = tensor(top_k, torch.int64) if any(top_k) else None
        top_p = [p.top_p for p in randoms]
        self.top_p = tensor(top_p, torch.float32) if any(x < 1.0 for x in top_p) else None
        min_p = [p.min_p for p in randoms]
        self.min_p = tensor(min_p, torch.float32) if any(x > 0.0 for x in min_p) else None

    def sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft tokens ``[n]`` for rows ``0..n-1`` of the batch (``n = len(logits)``) and the
        ``[n, vocab]`` distributions the random rows drew from (None when all are greedy;
        greedy rows' rows are meaningless). No host sync."""
        logits = self._fit_vocabulary(logits.float())
        if self.all_greedy:
            return logits.argmax(dim=-1), None
        n = logits.shape[0]
        scaled = logits / self.temperature[:n, None]
        scaled = apply_top_k_top_p_min_p(
            scaled, None if self.top_k is None else self.top_k[:n],
            None if self.top_p is None else self.top_p[:n],
            None if self.min_p is None else self.min_p[:n])
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.default_generator)
        for row, generator in self.generators.items():
            if row < n:
                noise[row].exponential_(generator=generator)
        tokens = (probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
        if any(self.greedy):
            tokens = torch.where(self.greedy_mask[:n], logits.argmax(dim=-1), tokens)
        return tokens, probs

    def _fit_vocabulary(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary: a draft checkpoint whose embedding is padded
        to another size (same tokenizer) loses its padding rows or gains impossible ones."""
        width = logits.shape[-1]
        if width > self.vocab_size:
            return logits[:, : self.vocab_size]
        if width < self.vocab_size:
            pad = logits.new_full((logits.shape[0], self.vocab_size - width), float("-inf"))
            return torch.cat([logits, pad], dim=-1)
        return logits


def draft_seed(seed: int) -> int:
    """The seed of draft noise (a seeded request's, or the engine's for the others): a
    function of the seed, never the seed itself. The target's sampler draws its noise from
    ``seed``; the same stream here would make the noise that verifies one draft the noise
    that chose a later one, and the accepted drafts' positions would then not follow ``q``
    (biased output). An odd multiplier plus one has no fixed point modulo 2**64."""
    return (seed * 0x9E3779B97F4A7C15 + 1) % 2**64
