"""Incremental detokenization and stop strings.

Decoding all output tokens every step costs O(n^2). Instead each step decodes a short window:
the text of ``tokens[prefix_offset:read_offset]`` (already emitted) and of
``tokens[prefix_offset:]``; the new text is the difference. Decoding with a few tokens of
context keeps tokenizers that drop or add leading spaces correct, and a trailing U+FFFD means a
multi-byte character is incomplete, so nothing is emitted until its remaining bytes arrive.
"""

from __future__ import annotations

from typing import Any

from hitchllm.sampling_params import SamplingParams

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns one sequence's new tokens into new text and watches for stop strings."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self.tokens: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""
        self.stop_reason: str | None = None
        # Longest stop string minus one: how far back a match may start in old text.
        self._stop_lookback = max((len(s) for s in params.stop_strings), default=1) - 1

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(
            tokens,
            skip_special_tokens=self.params.skip_special_tokens,
            spaces_between_special_tokens=self.params.spaces_between_special_tokens,
        )

    def add_token(self, token: int) -> bool:
        """Append one token; returns True when a stop string ended the sequence.

        Tokens go in one at a time so a stop string ends the text (and the caller can cut the
        token ids) at the token that completed it, however many tokens a step produced.
        """
        self.tokens.append(token)
        return self._emit(final=False)

    def flush(self) -> None:
        """The sequence ended: emit text held back for an incomplete character."""
        self._emit(final=True)

    def _emit(self, final: bool) -> bool:
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.tokens[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or (full_text.endswith("\ufffd") and not final):
            return False
        new_text = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        start = max(0, len(self.text) - self._stop_lookback)
        self.text += new_text
        return self._check_stop_strings(start)

    def _check_stop_strings(self, start: int) -> bool:
        found = [(pos, stop) for stop in self.params.stop_strings
                 if (pos := self.text.find(stop, start)) != -1]
        if not found:
            return False
        pos, stop = min(found)  # the earliest match ends the sequence
        end = pos + len(stop) if self.params.include_stop_str_in_output else pos
        self.text = self.text[:end]
        self.stop_reason = stop
        return True
