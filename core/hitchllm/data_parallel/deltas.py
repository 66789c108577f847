"""Request outputs as deltas on the pipe between a replica and the server.

The engine's outputs are cumulative (each holds the whole text and every token so far), which
the serving layer relies on; pickling them whole every step would cost time quadratic in the
output length, on both sides of the pipe. A replica sends what changed since the last output
it sent for the request (``OutputEncoder``) and the server rebuilds the cumulative output
(``OutputDecoder``). Text and lists that grew send their new tail; anything else (a text cut
back by a stop string) is sent whole, so decoding is exact whatever the engine does. Most
outputs (one sequence that grew by a token or a few) cross as a ``GrowDelta``, a 3-tuple.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hitchllm.outputs import CompletionOutput, RequestOutput


@dataclass(slots=True)
class SequenceDelta:
    """One sequence: keep the first ``*_keep`` items of the previous output, then add."""

    index: int
    text_keep: int
    text: str
    tokens_keep: int
    token_ids: list[int]
    logprobs_keep: int
    logprobs: list[Any] | None
    finish_reason: str | None
    stop_reason: int | str | None
    cumulative_logprob: float | None

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Pickled as the constructor's arguments: a tuple, without field names per delta
        # (a third of the time and bytes of the default pickle).
        return SequenceDelta, (self.index, self.text_keep, self.text, self.tokens_keep,
                               self.token_ids, self.logprobs_keep, self.logprobs,
                               self.finish_reason, self.stop_reason, self.cumulative_logprob)


@dataclass(slots=True)
class OutputDelta:
    """One output of a request; ``prompt`` (prompt text, token ids and logprobs) only when
    it differs from the last output sent (always in the first)."""

    request_id: str
    finished: bool
    sequences: list[SequenceDelta]
    num_cached_tokens: int
    metrics: dict[str, float]
    error: str | None
    prompt: tuple[Any, list[int], Any] | None = None
    # A producer's KV-transfer parameters (disaggregated serving), in its finished output.
    kv_transfer_params: dict[str, Any] | None = None

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return OutputDelta, (self.request_id, self.finished, self.sequences,
                             self.num_cached_tokens, self.metrics, self.error, self.prompt,
                             self.kv_transfer_params)



# The common output: one sequence, no logprobs, not finished, whose text and token ids only
# grew and whose other fields did not change. Only ``(request_id, new text, new token ids)``
# crosses: a plain tuple, which pickle writes and reads in C (an ``OutputDelta`` costs several
# times more to build and pickle, on the engine thread).
GrowDelta = tuple[str, str, list[int]]


def _grown(old: RequestOutput, out: RequestOutput) -> GrowDelta | None:
    """``out`` as a ``GrowDelta`` after ``old``, if it is one."""
    if out.finished or len(out.outputs) != 1 or len(old.outputs) != 1:
        return None
    new, prev = out.outputs[0], old.outputs[0]
    n = len(prev.token_ids)
    if (new.logprobs is None and new.finish_reason is None and new.stop_reason is None
            and new.index == prev.index and new.cumulative_logprob is None
            and out.prompt_token_ids is old.prompt_token_ids and out.prompt is old.prompt
            and out.prompt_logprobs is None and old.prompt_logprobs is None
            and out.error is None and out.kv_transfer_params is None
            and out.num_cached_tokens == old.num_cached_tokens and out.metrics == old.metrics
            and new.text.startswith(prev.text) and new.token_ids[:n] == prev.token_ids
            and len(new.token_ids) >= n):
        return out.request_id, new.text[len(prev.text):], new.token_ids[n:]
    return None


def _kept(old: list[Any], new: list[Any]) -> int:
    """How much of ``old`` starts ``new`` (all of it, or nothing)."""
    return len(old) if len(new) >= len(old) and new[:len(old)] == old else 0


def _sequence_delta(old: CompletionOutput | None, new: CompletionOutput) -> SequenceDelta:
    if old is None:
        return SequenceDelta(new.index, 0, new.text, 0, new.token_ids, 0, new.logprobs,
                             new.finish_reason, new.stop_reason, new.cumulative_logprob)
    text_keep = len(old.text) if new.text.startswith(old.text) else 0
    tokens_keep = _kept(old.token_ids, new.token_ids)
    logprobs_keep = 0
    if old.logprobs is not None and new.logprobs is not None and tokens_keep:
        # One entry per token: when the tokens only grew, so did the entries.
        logprobs_keep = min(len(old.logprobs), len(new.logprobs))
    return SequenceDelta(
        new.index, text_keep, new.text[text_keep:], tokens_keep, new.token_ids[tokens_keep:],
        logprobs_keep, None if new.logprobs is None else new.logprobs[logprobs_keep:],
        new.finish_reason, new.stop_reason, new.cumulative_logprob)


class OutputEncoder:
    """The replica's side: remembers the last output sent per request."""

    def __init__(self) -> None:
        self._last: dict[str, RequestOutput] = {}

    def encode(self, out: RequestOutput) -> OutputDelta | GrowDelta:
        old = self._last.get(out.request_id)
        if old is not None and (grown := _grown(old, out)) is not None:
            self._last[out.request_id] = out
            return grown
        olds: dict[int, CompletionOutput] = {} if old is None else {
            s.index: s for s in old.outputs}
        prompt = (out.prompt, out.prompt_token_ids, out.prompt_logprobs)
        if old is not None and prompt == (old.prompt, old.prompt_token_ids,
                                          old.prompt_logprobs):
            prompt = None  # type: ignore[assignment]
        if out.finished:
            self._last.pop(out.request_id, None)
        else:
            self._last[out.request_id] = out
        return OutputDelta(out.request_id, out.finished,
                           [_sequence_delta(olds.get(s.index), s) for s in out.outputs],
                           out.num_cached_tokens, out.metrics, out.error, prompt,
                           out.kv_transfer_params)

    def forget(self, request_id: str) -> None:
        self._last.pop(request_id, None)


class OutputDecoder:
    """The server's side: rebuilds each request's cumulative output."""

    def __init__(self) -> None:
        self._last: dict[str, RequestOutput] = {}

    def decode(self, delta: OutputDelta | GrowDelta) -> RequestOutput:
        if type(delta) is tuple:
            return self._grow(delta)
        old = self._last.get(delta.request_id)
        olds = {} if old is None else {s.index: s for s in old.outputs}
        if delta.prompt is not None:
            prompt, prompt_ids, prompt_lps = delta.prompt
        else:
            assert old is not None, f"no earlier output of {delta.request_id}"
            prompt, prompt_ids, prompt_lps = old.prompt, old.prompt_token_ids, old.prompt_logprobs
        sequences = []
        for d in delta.sequences:
            prev = olds.get(d.index)
            logprobs = d.logprobs
            if logprobs is not None and prev is not None and prev.logprobs is not None:
                logprobs = prev.logprobs[:d.logprobs_keep] + logprobs
            sequences.append(CompletionOutput(
                d.index,
                (prev.text[:d.text_keep] if prev else "") + d.text,
                (prev.token_ids[:d.tokens_keep] if prev else []) + d.token_ids,
                d.finish_reason, d.stop_reason, logprobs, d.cumulative_logprob))
        out = RequestOutput(delta.request_id, prompt, prompt_ids, sequences, delta.finished,
                            prompt_lps, delta.num_cached_tokens, delta.metrics, delta.error,
                            delta.kv_transfer_params)
        if delta.finished:
            self._last.pop(delta.request_id, None)
        else:
            self._last[delta.request_id] = out
        return out

    def _grow(self, delta: GrowDelta) -> RequestOutput:
        request_id, text, token_ids = delta
        old = self._last[request_id]
        prev = old.outputs[0]
        seq = CompletionOutput(prev.index, prev.text + text, prev.token_ids + token_ids)
        out = RequestOutput(request_id, old.prompt, old.prompt_token_ids, [seq], False, None,
                            old.num_cached_tokens, old.metrics)
        self._last[request_id] = out
        return out

    def forget(self, request_id: str) -> None:
        self._last.pop(request_id, None)
