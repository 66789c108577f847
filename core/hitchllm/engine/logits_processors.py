"""The core's logits processors: ``logit_bias``, ``allowed_token_ids`` and ``bad_words``.

Registered by ``hitchllm.builtins`` through the ``hitchllm_logits_processors`` hook, like any
plugin's. Each gathers its rows' ids on the host into flat index tensors, so one step costs a
few tensor ops whatever the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hitchllm.logits_processor import LogitsEdit, LogitsProcessor, LogitsRow, host_to_device
from hitchllm.sampling_params import SamplingParams


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return host_to_device(torch.tensor(values, dtype=torch.int64), device)


def _forbid(rows: list[int], token_ids: list[int], device: torch.device) -> LogitsEdit:
    """An edit setting ``logits[rows[i], token_ids[i]]`` to -inf."""
    if not rows:
        return lambda logits: logits
    r, t = _index(rows, device), _index(token_ids, device)

    def edit(logits: torch.Tensor) -> torch.Tensor:
        minus_inf = torch.full((len(rows),), float("-inf"), device=logits.device)
        return logits.index_put((r, t), minus_inf)

    return edit


class LogitBias(LogitsProcessor):
    """Adds ``SamplingParams.logit_bias[token]`` to the token's logit (OpenAI semantics)."""

    needs_output_tokens = False
    provides = ("logit_bias",)

    def is_used_by(self, params: SamplingParams) -> bool:
        return bool(params.logit_bias)

    def prepare(self, rows: list[LogitsRow], vocab_size: int, device: torch.device) -> LogitsEdit:
        row_ids: list[int] = []
        token_ids: list[int] = []
        biases: list[float] = []
        for row in rows:
            assert row.params.logit_bias is not None
            row_ids += [row.index] * len(row.params.logit_bias)
            token_ids += row.params.logit_bias.keys()
            biases += row.params.logit_bias.values()
        r, t = _index(row_ids, device), _index(token_ids, device)
        bias = host_to_device(torch.tensor(biases, dtype=torch.float32), device)
        return lambda logits: logits.index_put((r, t), bias, accumulate=True)


class AllowedTokenIds(LogitsProcessor):
    """Only ``SamplingParams.allowed_token_ids`` keep their logits; every other id gets -inf."""

    needs_output_tokens = False
    provides = ("allowed_token_ids",)

    def is_used_by(self, params: SamplingParams) -> bool:
        return params.allowed_token_ids is not None

    def prepare(self, rows: list[LogitsRow], vocab_size: int, device: torch.device) -> LogitsEdit:
        row_ids: list[int] = []
        token_ids: list[int] = []
        for row in rows:
            assert row.params.allowed_token_ids is not None
            row_ids += [row.index] * len(row.params.allowed_token_ids)
            token_ids += row.params.allowed_token_ids
        restricted = _index([row.index for row in rows], device)
        r, t = _index(row_ids, device), _index(token_ids, device)

        def edit(logits: torch.Tensor) -> torch.Tensor:
            keep = torch.ones_like(logits, dtype=torch.bool)
            keep[restricted] = False
            keep[r, t] = True
            return logits.masked_fill(~keep, float("-inf"))

        return edit


def bad_word_sequences(tokenizer: Any, words: Sequence[str]) -> list[tuple[int, ...]]:
    """The token sequences of ``words``, each tokenized without and with a leading space
    (a word starts the text or follows a space), distinct, in order."""
    sequences: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                sequences[ids] = None
    return list(sequences)


def banned_next_tokens(
    sequences: Sequence[tuple[int, ...]], output_token_ids: Sequence[int]
) -> list[int]:
    """Tokens that would complete one of ``sequences`` after ``output_token_ids``: the last
    token of every sequence whose other tokens end the output (always, for one-token ones)."""
    banned = []
    for seq in sequences:
        head = seq[:-1]
        if len(head) <= len(output_token_ids) and (
            not head or tuple(output_token_ids[len(output_token_ids) - len(head):]) == head
        ):
            banned.append(seq[-1])
    return banned


class BadWords(LogitsProcessor):
    """Forbids the token that would complete a word of ``SamplingParams.bad_words``."""

    provides = ("bad_words",)

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._sequences: dict[str, list[tuple[int, ...]]] = {}

    def is_used_by(self, params: SamplingParams) -> bool:
        return bool(params.bad_words)

    def remove_requests(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._sequences.pop(rid, None)

    def prepare(self, rows: list[LogitsRow], vocab_size: int, device: torch.device) -> LogitsEdit:
        row_ids: list[int] = []
        token_ids: list[int] = []
        for row in rows:
            sequences = self._sequences.get(row.request_id)
            if sequences is None:
                assert row.params.bad_words is not None
                sequences = bad_word_sequences(self.tokenizer, row.params.bad_words)
                self._sequences[row.request_id] = sequences
            banned = banned_next_tokens(sequences, row.output_token_ids)
            row_ids += [row.index] * len(banned)
            token_ids += banned
        return _forbid(row_ids, token_ids, device)
