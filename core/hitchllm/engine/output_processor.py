"""Turns engine-side requests into user-facing outputs: detokenization, stop strings,
logprobs, and fan-in of the ``n`` sequences of a parallel-sampling request."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from hitchllm.engine.detokenizer import IncrementalDetokenizer
from hitchllm.outputs import CompletionOutput, Logprob, RequestOutput
from hitchllm.request import Request


@dataclass
class SequenceState:
    """One child sequence of a user request."""

    index: int
    request: Request
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_tokens_seen: int = 0
    # Sum of the sampled tokens' logprobs; None unless logprobs were asked.
    cumulative_logprob: float | None = None


@dataclass
class ParentState:
    """A user request: prompt plus its ``n`` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[SequenceState]
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    # prompt index -> entry, when prompt logprobs were asked (children share the prompt)
    prompt_logprobs: dict[int, dict[int, Logprob]] | None = None
    # Only the finished output is wanted (offline generation): no output per step.
    final_only: bool = False

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)


class OutputProcessor:
    """Keeps per-request output state between steps."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        # child request id -> (parent, index of the child among the parent's sequences)
        self._parent_of: dict[str, tuple[ParentState, int]] = {}
        # token id -> its text decoded alone (``Logprob.decoded_token``); bounded by the vocab.
        self._token_texts: dict[int, str] = {}

    def add(
        self, request_id: str, prompt: str | None, children: list[Request],
        final_only: bool = False,
    ) -> None:
        seqs = []
        for i, child in enumerate(children):
            params = child.sampling_params
            detok = (
                IncrementalDetokenizer(self.tokenizer, child.prompt_token_ids, params)
                if params.detokenize else None
            )
            logprobs = [] if params.logprobs is not None else None
            seqs.append(SequenceState(i, child, detok, logprobs,
                                      cumulative_logprob=None if logprobs is None else 0.0))
        parent = ParentState(request_id, prompt, children[0].prompt_token_ids, seqs,
                             final_only=final_only)
        if children[0].sampling_params.prompt_logprobs is not None:
            parent.prompt_logprobs = {}
        self.parents[request_id] = parent
        for i, child in enumerate(children):
            self._parent_of[child.request_id] = (parent, i)

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return [s.request.request_id for s in parent.sequences] if parent else []

    def process(
        self,
        updated: list[Request],
        logprobs: dict[str, list[dict[int, Logprob]]],
        prompt_logprobs: dict[str, list[tuple[int, dict[int, Logprob]]]],
    ) -> tuple[list[RequestOutput], list[str]]:
        """Fold one step's tokens in. Returns the outputs of parents that changed, and the ids
        of child requests a stop string has just finished (the engine stops them)."""
        now = time.monotonic()
        stopped: list[str] = []
        touched: dict[str, ParentState] = {}
        for rid, entries in prompt_logprobs.items():
            if rid in self._parent_of:
                parent = self._parent_of[rid][0]
                if parent.prompt_logprobs is not None:
                    if parent.sequences[0].request.sampling_params.detokenize:
                        self._decode_entries(entry for _, entry in entries)
                    parent.prompt_logprobs.update(entries)
        for request in updated:
            parent, index = self._parent_of[request.request_id]
            seq = parent.sequences[index]
            if parent.first_token_time is None:
                parent.first_token_time = now
            # The request may have kept fewer tokens than were emitted (a stop condition in
            # the middle of accepted drafts), so read them back from the request.
            tokens = request.output_token_ids[seq.num_tokens_seen :]
            kept = len(tokens)
            detok = seq.detokenizer
            if detok is not None:
                for i, token in enumerate(tokens):
                    if detok.add_token(token):
                        kept = i + 1
                        seq.finish_reason, seq.stop_reason = "stop", detok.stop_reason
                        request.truncate_output(seq.num_tokens_seen + kept)
                        if not request.finished:
                            stopped.append(request.request_id)
                        break
            if seq.logprobs is not None and request.request_id in logprobs:
                new_entries = logprobs[request.request_id][:kept]
                if request.sampling_params.detokenize:
                    self._decode_entries(new_entries)
                seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + sum(
                    entry[token].logprob for token, entry in zip(tokens, new_entries))
                seq.logprobs.extend(new_entries)
            seq.num_tokens_seen += kept
            if seq.finish_reason is None and request.finished:
                if detok is not None:
                    detok.flush()
                seq.finish_reason = request.status.finish_reason
                seq.stop_reason = request.stop_reason
            touched[parent.request_id] = parent
        outputs = []
        for parent in touched.values():
            finished = parent.finished
            if finished or not parent.final_only:
                outputs.append(self._output(parent, finished))
            if finished:
                self._forget(parent)
        return outputs, stopped

    def _decode_entries(self, entries: Iterable[dict[int, Logprob]]) -> None:
        """Fill ``decoded_token`` of every logprob in ``entries``."""
        texts = self._token_texts
        for entry in entries:
            for token, logprob in entry.items():
                if token not in texts:
                    texts[token] = self.tokenizer.decode([token])
                logprob.decoded_token = texts[token]

    def parent_id(self, child_request_id: str) -> str | None:
        """The user request a child sequence belongs to."""
        found = self._parent_of.get(child_request_id)
        return found[0].request_id if found else None

    def abort(self, request_id: str, error: str | None = None) -> RequestOutput | None:
        """End every unfinished sequence of ``request_id`` (``finish_reason`` "abort", or
        "error" when ``error`` says why) and drop its state."""
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        for seq in parent.sequences:
            if seq.finish_reason is None:
                seq.finish_reason = "abort" if error is None else "error"
        self._forget(parent)
        out = self._output(parent, finished=True)
        out.error = error
        return out

    def _forget(self, parent: ParentState) -> None:
        self.parents.pop(parent.request_id, None)
        for seq in parent.sequences:
            self._parent_of.pop(seq.request.request_id, None)

    def _output(self, parent: ParentState, finished: bool) -> RequestOutput:
        completions = []
        for seq in parent.sequences:
            text = seq.detokenizer.text if seq.detokenizer is not None else ""
            completions.append(CompletionOutput(
                index=seq.index,
                text=text,
                token_ids=list(seq.request.output_token_ids),
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                cumulative_logprob=seq.cumulative_logprob,
            ))
        metrics = {"arrival_time": parent.arrival_time}
        if parent.first_token_time is not None:
            metrics["first_token_time"] = parent.first_token_time
        prompt_lps = None
        if parent.prompt_logprobs is not None:
            found = parent.prompt_logprobs
            prompt_lps = [None] + [found.get(i) for i in range(1, len(parent.prompt_token_ids))]
        first = parent.sequences[0]
        kv_params = None
        if first.request.kv_transfer_out is not None and first.finish_reason in ("stop",
                                                                                "length"):
            kv_params = first.request.kv_transfer_out
        return RequestOutput(
            kv_transfer_params=kv_params,
            request_id=parent.request_id,
            prompt_logprobs=prompt_lps,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=parent.sequences[0].request.num_cached_prompt_tokens,
            metrics=metrics,
        )

