"""Hugging Face's beam search bookkeeping for one prompt, as plain Python.

``BeamScorer.step`` takes the running beams' log probabilities for their next token and says
which (beam, token) continuations run next, exactly as transformers' ``generate(num_beams=k,
do_sample=False)`` does (its ``_beam_search``):

- Of every beam's continuations, the best ``K = max(2, 1 + number of EOS ids) * k`` by
  cumulative log probability are candidates (``K`` so that at least ``k`` of them do not end).
- A candidate ends when its token is an EOS id (unless ``ignore_eos``) or it reaches
  ``max_tokens``. Ended candidates among the best ``k`` enter the finished list, scored
  ``cumulative logprob / generated_length ** length_penalty`` (the EOS token counts in the
  length); the finished list keeps the best ``k``.
- The best ``k`` candidates that did not end are the next running beams.
- The search ends at ``max_tokens``, or by ``early_stopping``: ``True`` once ``k`` sequences
  finished; ``False`` (Hugging Face's default, and ours) once ``k`` finished and the best
  running beam's score at its current length cannot beat the worst finished one;
  ``"never"`` the same, but with the longest possible length when ``length_penalty > 0``.
"""

from __future__ import annotations

from dataclasses import dataclass

EarlyStopping = bool | str


@dataclass
class Hypothesis:
    """A finished sequence: generated token ids, their summed log probability, its score."""

    token_ids: list[int]
    cum_logprob: float
    score: float
    finish_reason: str  # "stop" (an EOS id) or "length" (max_tokens)


@dataclass(frozen=True)
class Continuation:
    """Extend running beam ``beam`` by ``token``; the new beam's cumulative logprob."""

    beam: int
    token: int
    cum_logprob: float


class BeamScorer:
    """One prompt's search state: its finished hypotheses and whether it is done."""

    def __init__(self, beam_width: int, max_tokens: int, eos_token_ids: tuple[int, ...],
                 length_penalty: float = 1.0, early_stopping: EarlyStopping = False) -> None:
        self.beam_width = beam_width
        self.max_tokens = max_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.num_candidates = max(2, 1 + len(self.eos_token_ids)) * beam_width
        self.finished: list[Hypothesis] = []  # best first, at most beam_width
        self.num_generated = 0  # tokens of each running beam
        self.done = False

    def step(self, beams: list[tuple[list[int], float]],
             logprobs: list[dict[int, float]]) -> list[Continuation]:
        """Advance by one token. ``beams`` are the running beams (token ids, cumulative
        logprob), ``logprobs[i]`` beam ``i``'s top ``num_candidates`` next tokens and their
        log probabilities. Returns the continuations to run next (empty once ``done``)."""
        if self.done:
            raise RuntimeError("the beam search of this prompt is already done")
        candidates = sorted(
            ((cum + lp, i, token) for i, (_, cum) in enumerate(beams)
             for token, lp in logprobs[i].items()),
            key=lambda c: (-c[0], c[1], c[2]))[: self.num_candidates]
        length = self.num_generated + 1
        at_max = length >= self.max_tokens
        ended = [at_max or token in self.eos_token_ids for _, _, token in candidates]
        new = [Hypothesis(beams[i][0] + [token], cum, cum / length ** self.length_penalty,
                          "stop" if token in self.eos_token_ids else "length")
               for (cum, i, token), end in zip(candidates[: self.beam_width], ended) if end]
        # Stable: an earlier hypothesis wins a tie, as Hugging Face's merge keeps it first.
        self.finished = sorted(self.finished + new, key=lambda h: -h.score)[: self.beam_width]
        running = [Continuation(i, token, cum)
                   for (cum, i, token), end in zip(candidates, ended) if not end]
        running = running[: self.beam_width]
        self.num_generated = length
        if at_max or not running:
            self.done = True
            return []
        if len(self.finished) == self.beam_width:
            if self.early_stopping is True:
                self.done = True
                return []
            hypothetical = length
            if self.early_stopping == "never" and self.length_penalty > 0:
                hypothetical = self.max_tokens
            best = running[0].cum_logprob / hypothetical ** self.length_penalty
            if best <= min(h.score for h in self.finished):
                self.done = True
                return []
        return running
