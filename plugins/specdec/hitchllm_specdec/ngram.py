"""``ngram``: prompt lookup decoding.

The drafts for a request are what followed the last time its context ended the way it ends
now: the longest ``n`` in ``prompt_lookup_max .. prompt_lookup_min`` whose last ``n`` tokens
also occur earlier in the context wins, and of that n-gram's earlier occurrences the most
recent one; the up to ``max_num_drafts`` tokens after it are the drafts. They are a
deterministic function of the context, so no draft probabilities are returned (the core
verifies them as point masses, which keeps the output exactly the target's).

Cost per request and step, for a context of ``L`` tokens with ``C`` earlier occurrences of
its last token and ``N = prompt_lookup_max``: appending the step's new tokens to a cached
int32 copy of the context (O(new tokens); the Python list is converted once, O(L), when a
request is first seen), one vectorized comparison of the context against its last token
(O(L) numpy work, a few microseconds at L = 10^4), and N - 1 vectorized filters of the C
candidate positions (O(C N)). No Python loop runs per token or per position.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hitchllm.config import EngineConfig
from hitchllm.speculative import Draft, Proposal, ProposalBatch, Proposer

# How many of the cached context's last tokens are compared with the request's tokens before
# the cache is extended (see ``ContextCache.view``).
_CHECKED_TAIL = 8


def propose_ngram(context: np.ndarray, min_n: int, max_n: int, max_drafts: int) -> np.ndarray:
    """The drafts for ``context`` (a 1-D integer array): the tokens that followed the most
    recent earlier occurrence of its longest suffix of ``min_n..max_n`` tokens that occurs
    earlier, at most ``max_drafts`` of them; empty when no suffix of ``min_n`` tokens recurs.

    An occurrence may overlap the suffix itself, but must end before the context's last token
    (so that at least one token follows it)."""
    length = len(context)
    if length < 2 or max_drafts < 1:
        return context[:0]
    # Candidate end positions of an earlier occurrence: where the last token recurs.
    ends = np.flatnonzero(context[: length - 1] == context[length - 1])
    ends = ends[ends >= min_n - 1]
    if ends.size == 0:
        return context[:0]
    # Grow every candidate's match backwards, one suffix position at a time (max_n - 1
    # vectorized steps); a candidate drops out at its first mismatch or at the start.
    matched = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for back in range(1, min(max_n, length - 1)):
        positions = ends - back
        alive &= positions >= 0
        alive[alive] = context[positions[alive]] == context[length - 1 - back]
        if not alive.any():
            break
        matched += alive
    longest = int(matched.max())
    if longest < min_n:
        return context[:0]
    # ``ends`` is ascending: the last candidate with the longest match is the most recent.
    end = int(ends[np.flatnonzero(matched == longest)[-1]])
    return context[end + 1 : end + 1 + max_drafts]


class ContextCache:
    """An int32 copy of each request's context, extended by the tokens added since the
    previous step instead of converted from the engine's list every step.

    A request id seen again with a different context (an id reused after its request ended)
    is caught by comparing lengths, the prompt length and the cached tail with the request's
    tokens; a mismatch rebuilds the copy. A miss that escapes this check costs acceptance only:
    every draft is verified against the target model."""

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}
        self._lengths: dict[str, int] = {}
        self._prompt_lengths: dict[str, int] = {}

    def view(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int
             ) -> np.ndarray:
        """The request's context as an int32 array (a view into the cache)."""
        length = len(token_ids)
        array = self._arrays.get(request_id)
        known = self._lengths.get(request_id, 0)
        if array is None or not self._same_request(request_id, array, known, token_ids,
                                                   num_prompt_tokens):
            array = np.empty(max(2 * length, 64), dtype=np.int32)
            known = 0
            self._prompt_lengths[request_id] = num_prompt_tokens
        if length > array.size:
            grown = np.empty(2 * length, dtype=np.int32)
            grown[:known] = array[:known]
            array = grown
        array[known:length] = token_ids[known:length]
        self._arrays[request_id] = array
        self._lengths[request_id] = length
        return array[:length]

    def _same_request(self, request_id: str, array: np.ndarray, known: int,
                      token_ids: Sequence[int], num_prompt_tokens: int) -> bool:
        if known > len(token_ids) or self._prompt_lengths[request_id] != num_prompt_tokens:
            return False
        start = max(0, known - _CHECKED_TAIL)
        return array[start:known].tolist() == list(token_ids[start:known])

    def keep_only(self, request_ids: set[str]) -> None:
        """Forget the requests not in ``request_ids`` (finished, or not decoding now)."""
        for request_id in [r for r in self._arrays if r not in request_ids]:
            del self._arrays[request_id], self._lengths[request_id]
            del self._prompt_lengths[request_id]


class NgramProposer(Proposer):
    """Prompt lookup: drafts copied from the request's own context (see the module
    docstring); ``prompt_lookup_min`` / ``prompt_lookup_max`` bound the n-gram size."""

    def __init__(self, engine_config: EngineConfig) -> None:
        super().__init__(engine_config)
        if engine_config.speculative_model is not None:
            raise ValueError(
                f"speculative_model={engine_config.speculative_model!r} is set, but the ngram "
                "proposer drafts from the request's own context and loads no model; drop "
                "speculative_model, or use speculative_method='draft_model' (a smaller model) "
                "or 'eagle' (an EAGLE head)"
            )
        self.min_n = engine_config.prompt_lookup_min
        self.max_n = engine_config.prompt_lookup_max
        self.contexts = ContextCache()

    def propose(self, batch: ProposalBatch) -> Proposal:
        drafts = {}
        for r in batch.requests:
            context = self.contexts.view(r.request_id, r.token_ids, r.num_prompt_tokens)
            tokens = propose_ngram(context, self.min_n, self.max_n, r.max_num_drafts)
            if tokens.size:
                drafts[r.request_id] = Draft(tokens.tolist())
        self.contexts.keep_only({r.request_id for r in batch.requests})
        return Proposal(drafts)
