"""Helpers shared by the streaming endpoints: SSE framing, merging several requests' output
streams, and holding back text that may still turn out to be the start of a stop string."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, TypeVar

T = TypeVar("T")

_DONE = object()


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event carrying ``payload`` (a JSON object, or a literal like [DONE])."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


async def merge(iterators: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as they come, tagged with the iterator's index.

    Closing the merged iterator early cancels the readers, which closes each source (so the
    engine aborts the requests behind them).
    """
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, it: AsyncIterator[T]) -> None:
        try:
            async for item in it:
                await queue.put((i, item))
        except BaseException as exc:
            await queue.put((i, exc))
            raise
        finally:
            await queue.put((i, _DONE))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iterators)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def stream_safe_length(text: str, stop: list[str], finished: bool) -> int:
    """How much of ``text`` may be sent: while a sequence runs, the last ``len(stop) - 1``
    characters could still become a stop string and be cut from the final text."""
    if finished or not stop:
        return len(text)
    return max(0, len(text) - (max(len(s) for s in stop) - 1))
