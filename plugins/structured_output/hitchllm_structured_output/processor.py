"""The logits processor: each step, a token bitmask per constrained row, applied in one go.

Each constrained request has a matcher that follows its output. At every step the matcher
first consumes the tokens the request has output since the last step, then writes the row's
bitmask (one bit per vocabulary id: may this token come next?). llguidance fills the rows of
a batch in parallel threads; the bitmask is copied to the device once and unpacked there, so
the sampler sees -inf for every token the grammar forbids. When the grammar is complete the
only allowed tokens are the end-of-sequence ids, so the request stops with ``"stop"``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import torch

from hitchllm import SamplingParams
from hitchllm.logits_processor import LogitsEdit, LogitsProcessor, LogitsRow, host_to_device
from hitchllm_structured_output.grammar import GrammarCache

logger = logging.getLogger(__name__)


def _bitmask_ops() -> Any:
    """``llguidance.torch``, imported on first use: it compiles a kernel with torch.compile
    when imported, which loads dynamo and inductor, seconds of every engine's start-up
    (issue 22: 4.7 of 10 s to the first token of ``hitchllm generate`` on a 2-core VM)."""
    import llguidance.torch

    return llguidance.torch


@dataclass
class _RequestGrammar:
    """One request's matcher and how many of its output tokens it has consumed."""

    matcher: llguidance.LLMatcher
    num_consumed: int = 0

    def follow(self, output_token_ids: Sequence[int]) -> None:
        """Bring the matcher to the end of ``output_token_ids``.

        A complete grammar consumes nothing more: its end-of-sequence token already finished
        the request, which may still sit in a step that was scheduled before that was known.
        """
        if self.matcher.is_stopped():
            pass
        elif len(output_token_ids) < self.num_consumed:
            self.matcher.rollback(self.num_consumed - len(output_token_ids))
        elif len(output_token_ids) > self.num_consumed:
            self.matcher.consume_tokens(list(output_token_ids[self.num_consumed:]))
        self.num_consumed = len(output_token_ids)


class StructuredOutputProcessor(LogitsProcessor):
    """Enforces ``SamplingParams.structured_outputs`` with llguidance matchers."""

    provides = ("structured_outputs",)

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        if sys.byteorder != "little":
            raise RuntimeError("hitchllm-structured-output unpacks token bitmasks as "
                               "little-endian bytes; this host is big-endian")
        self.grammars = GrammarCache(tokenizer, vocab_size, eos_token_ids)
        self.eos_token_ids = list(eos_token_ids)
        self._requests: dict[str, _RequestGrammar] = {}
        self._executor: llguidance.LLExecutor | None = None
        self._shifts: dict[torch.device, torch.Tensor] = {}

    def is_used_by(self, params: SamplingParams) -> bool:
        return params.structured_outputs is not None

    def compile(self, params: SamplingParams) -> None:
        if params.ignore_eos:
            raise ValueError(
                "ignore_eos cannot be combined with structured_outputs: a complete output ends "
                "with the end-of-sequence token; drop ignore_eos (max_tokens still applies)."
            )
        assert params.structured_outputs is not None
        self.grammars.compiled(params.structured_outputs)

    def remove_requests(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._requests.pop(rid, None)

    def prepare(self, rows: list[LogitsRow], vocab_size: int, device: torch.device) -> LogitsEdit:
        bitmask = _bitmask_ops().allocate_token_bitmask(len(rows), vocab_size)
        parallel: list[tuple[llguidance.LLMatcher, int]] = []
        for i, row in enumerate(rows):
            state = self._state(row)
            state.follow(row.output_token_ids[: len(row.output_token_ids) - row.num_draft_tokens])
            if state.matcher.is_error():
                # Only reachable when the sampler could not obey the mask (every allowed token
                # was also forbidden, e.g. by min_tokens): end the output instead.
                logger.warning("request %s left its grammar: %s", row.request_id,
                               state.matcher.get_error())
                self._only_eos(bitmask[i])
            elif row.num_draft_tokens:
                self._fill_after_drafts(state.matcher, row, bitmask, i)
            else:
                parallel.append((state.matcher, i))
        if parallel:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            _bitmask_ops().fill_next_token_bitmask_par(self._executor, parallel, bitmask)
        return self._masking_edit(bitmask, [row.index for row in rows], vocab_size, device)

    def _state(self, row: LogitsRow) -> _RequestGrammar:
        state = self._requests.get(row.request_id)
        if state is None:
            assert row.params.structured_outputs is not None
            state = _RequestGrammar(self.grammars.compiled(row.params.structured_outputs)
                                    .deep_copy())
            self._requests[row.request_id] = state
        return state

    def _only_eos(self, bitmask_row: torch.Tensor) -> None:
        bitmask_row.zero_()
        for t in self.eos_token_ids:
            bit = 1 << (t % 32)
            bitmask_row[t // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # as int32

    @staticmethod
    def _fill_after_drafts(
        matcher: llguidance.LLMatcher, row: LogitsRow, bitmask: torch.Tensor, i: int
    ) -> None:
        """The row's mask as if its drafts were output; the matcher is left as it was."""
        drafts = list(row.output_token_ids[len(row.output_token_ids) - row.num_draft_tokens:])
        consumed = matcher.try_consume_tokens(drafts)
        # A draft the grammar rejects is forbidden by an earlier row's mask, so that row
        # rejects it and this row is never used: its mask (all allowed) does not matter.
        if consumed == len(drafts):
            _bitmask_ops().fill_next_token_bitmask(matcher, bitmask, i)
        if consumed:
            matcher.rollback(consumed)

    def _masking_edit(
        self, bitmask: torch.Tensor, row_indices: list[int], vocab_size: int,
        device: torch.device,
    ) -> LogitsEdit:
        # Unpacked byte-wise (one byte per token, not four). On a little-endian host (x86,
        # ARM), bit b of byte k of word w allows token 32 * w + 8 * k + b.
        mask = host_to_device(bitmask, device).view(torch.uint8)
        rows = host_to_device(torch.tensor(row_indices, dtype=torch.int64), device)
        shifts = self._shifts.get(device)
        if shifts is None:
            shifts = torch.arange(8, dtype=torch.uint8, device=device)
            self._shifts[device] = shifts

        def edit(logits: torch.Tensor) -> torch.Tensor:
            bits = (mask[:, :, None] >> shifts) & 1
            allowed_rows = bits.reshape(len(row_indices), -1)[:, :vocab_size].bool()
            allowed = torch.ones_like(logits, dtype=torch.bool)
            allowed[rows] = allowed_rows
            return logits.masked_fill(~allowed, float("-inf"))

        return edit
