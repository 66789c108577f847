"""From a request's ``StructuredOutputsParams`` to a compiled llguidance matcher, cached.

Compiling is the slow part (building the lexer and parser tables for the vocabulary); a
compiled matcher is kept per distinct constraint and each request gets a cheap copy.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from hitchllm import StructuredOutputsParams

# JSON is generated without optional whitespace: a small or unsure model otherwise tends to
# fill its budget with spaces and newlines, and compact JSON parses the same.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}


def grammar_text(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar for ``spec``; ``ValueError`` when the spec cannot be read."""
    kind = spec.kind
    if kind in ("json", "json_object"):
        schema: Any = {"type": "object"} if kind == "json_object" else spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from exc
        if not isinstance(schema, dict):
            raise ValueError("structured_outputs.json must be a JSON schema object.")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if kind == "regex":
        assert spec.regex is not None
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        assert spec.choice is not None
        # JSON string literals are valid Lark string literals, quotes and escapes included.
        alternatives = " | ".join(json.dumps(c) for c in spec.choice)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    assert spec.grammar is not None
    try:
        lark = any_to_lark(spec.grammar)
    except Exception as exc:  # the GBNF converter raises its own error types
        raise ValueError(f"structured_outputs.grammar cannot be read: {exc}") from exc
    return llguidance.LLMatcher.grammar_from_lark(lark)


def cache_key(spec: StructuredOutputsParams) -> str:
    """Equal for specs that compile to the same grammar."""
    value = getattr(spec, spec.kind)
    return spec.kind + ":" + json.dumps(value, sort_keys=True)


class GrammarCache:
    """Compiled matchers by constraint, least recently used evicted first; thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...],
                 capacity: int = 256) -> None:
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._capacity = capacity
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary, built on first use (about a second for a large
        vocabulary, so an engine whose requests never ask for structure never pays it)."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self._vocab_size,
                    eos_token=self._eos_token_ids or None)
            return self._ll_tokenizer

    def compiled(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The compiled matcher for ``spec`` (compiled now unless cached): a template that
        stays at the start, so take a ``deep_copy()`` (cheap) to follow an output.
        ``ValueError`` for a constraint llguidance rejects, with its message."""
        key = cache_key(spec)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return compiled
        # Compile outside the lock: two threads may compile the same spec, which is harmless.
        compiled = llguidance.LLMatcher(self.tokenizer(), grammar_text(spec), log_level=0)
        if compiled.is_error():
            raise ValueError(
                f"structured_outputs.{spec.kind} is invalid: {compiled.get_error()}"
            )
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > self._capacity:
                self._compiled.popitem(last=False)
        return compiled
