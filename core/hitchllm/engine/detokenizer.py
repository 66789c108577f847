"""Incremental detokenization and stop strings.

Decoding all output tokens every step costs O(n^2). Instead each step decodes a short window:
the text of ``tokens[prefix_offset:read_offset]`` (already emitted) and of
``tokens[prefix_offset:]``; the new text is the difference. Decoding with a few tokens of
context keeps tokenizers that drop or add leading spaces correct, and a trailing U+FFFD means a
multi-byte character is incomplete, so nothing is emitted until its remaining bytes arrive.

Fast (Rust) tokenizers do the same windowed decoding natively with ``tokenizers``'
``DecodeStream``, several times cheaper per token than two ``decode`` calls; it is used when the
tokenizer has one and needs no Python-side clean-up of the decoded text. Text held back at the
end (an incomplete character) is then flushed by the windowed path.
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
        self._stream, self._backend = _decode_stream(tokenizer, self.tokens, params)

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
        if self._stream is None:
            return self._emit(final=False)
        chunk = self._stream.step(self._backend, token)
        if not chunk:
            return False
        return self._append_text(chunk)

    def flush(self) -> None:
        """The sequence ended: emit text held back for an incomplete character."""
        self._emit(final=True)

    def _emit(self, final: bool) -> bool:
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.tokens[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or (full_text.endswith("\ufffd") and not final):
            return False
        return self._append_text(full_text[len(prefix_text) :])

    def _append_text(self, new_text: str) -> bool:
        """Every token so far is now in the text: append it and check stop strings."""
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


def _decode_stream(
    tokenizer: Any, context: list[int], params: SamplingParams
) -> tuple[Any, Any]:
    """A ``DecodeStream`` primed with ``context`` and the Rust tokenizer it steps with, or
    ``(None, None)`` when the tokenizer has none or its decoding needs Python-side clean-up."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None, None
    try:
        from tokenizers.decoders import DecodeStream

        stream = DecodeStream(ids=context, skip_special_tokens=params.skip_special_tokens)
    except (ImportError, TypeError):  # tokenizers < 0.22 cannot prime a stream
        return None, None
    return stream, backend
