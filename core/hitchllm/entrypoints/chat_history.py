"""Keeping a ``hitchllm chat`` conversation within the model's context: the oldest turns go
first; the system message and the newest user message stay."""

from __future__ import annotations

from collections.abc import Callable

Message = dict[str, str]


def reply_room(max_tokens: int | None, max_model_len: int) -> int:
    """Tokens kept free for the reply: ``max_tokens``, but at most half the context (a
    reply may still run on until the context is full)."""
    half = max_model_len // 2
    return half if max_tokens is None else min(max_tokens, half)


def fit_conversation(
    messages: list[Message], count_tokens: Callable[[list[Message]], int], budget: int
) -> tuple[list[Message], int]:
    """Drop the oldest messages until ``count_tokens(messages) <= budget``; returns the kept
    messages and how many were dropped.

    A leading system message is always kept, and the kept turns start with a user message
    (chat templates often insist that roles alternate from the user). Raises ``ValueError``
    when the newest message alone, with the system message, is over the budget.
    """
    system = messages[:1] if messages and messages[0]["role"] == "system" else []
    turns = messages[len(system) :]
    dropped = 0
    while (tokens := count_tokens(system + turns)) > budget:
        if len(turns) <= 1:
            raise ValueError(
                f"the message needs {tokens} prompt tokens, more than the {budget} the context "
                "leaves after room for the reply; send a shorter one"
                + (" or a shorter --system" if system else "")
            )
        turns = turns[1:]
        dropped += 1
        while len(turns) > 1 and turns[0]["role"] != "user":
            turns = turns[1:]
            dropped += 1
    return system + turns, dropped
