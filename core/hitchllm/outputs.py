"""What generation returns, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    """The log probability of one token, its 1-based rank under the model's distribution, and
    its text (the token decoded alone; None when the request asked for ``detokenize=False``)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence of a request (a request with ``n > 1`` has several)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # One dict per generated token (token id -> Logprob) when logprobs were requested.
    logprobs: list[dict[int, Logprob]] | None = None
    # Sum of the sampled tokens' logprobs when logprobs were requested, else None.
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's prompt and its outputs so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    # When prompt_logprobs was asked: None for the first prompt token, then one dict per token.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    # Set when the engine failed the request (finish_reason "error"); the engine goes on.
    error: str | None = None
    # A producer engine (disaggregated serving), once the request finished normally: what a
    # consumer engine needs to load the prompt's KV (pass it as its ``kv_transfer_params``).
    kv_transfer_params: dict[str, Any] | None = None
