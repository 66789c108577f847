"""The plugin's hook implementations (the entry point ``structured_output``)."""

from __future__ import annotations

from typing import Any

from hitchllm import hookimpl
from hitchllm_structured_output.processor import StructuredOutputProcessor


@hookimpl
def hitchllm_logits_processors(
    tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]
) -> list[StructuredOutputProcessor]:
    return [StructuredOutputProcessor(tokenizer, vocab_size, eos_token_ids)]
