"""Helpers shared by the streaming endpoints: SSE framing, merging several requests' output
streams, and holding back text that may still turn out to be the start of a stop string."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

T = TypeVar("T")


def _json_encoder() -> Callable[[Any], bytes]:
    """orjson when it is installed (several times faster per chunk than ``json``; it writes a
    non-finite number as null where ``json`` writes the non-standard -Infinity), else
    ``json``; both write UTF-8 text as it is, unescaped."""
    try:
        import orjson
    except ImportError:
        return lambda payload: json.dumps(payload, ensure_ascii=False).encode()
    return orjson.dumps


_encode_json = _json_encoder()


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event carrying ``payload`` (a JSON object, or a literal like [DONE])."""
    data = payload.encode() if isinstance(payload, str) else _encode_json(payload)
    return b"data: " + data + b"\n\n"


async def merge_latest(iterators: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators of cumulative snapshots (each item supersedes the
    ones before it from the same iterator), tagged with the iterator's index: in the order
    they come, but of each iterator only the newest item not yet taken, so a slow consumer
    skips stale snapshots instead of falling behind. An iterator that raises ends the merge
    with its exception.

    Closing the merged iterator early cancels the readers, which closes each source (so the
    engine aborts the requests behind them).
    """
    if len(iterators) == 1:  # no readers needed: the source itself keeps only the newest
        [it] = iterators
        try:
            async for item in it:
                yield 0, item
        finally:
            await it.aclose()  # type: ignore[attr-defined]
        return
    pending: dict[int, Any] = {}  # iterator index -> newest item not taken, in arrival order
    wake = asyncio.Event()

    async def pump(i: int, it: AsyncIterator[T]) -> None:
        try:
            async for item in it:
                pending[i] = item
                wake.set()
        except BaseException as exc:
            pending[i] = _Failed(exc)
            raise
        finally:
            finished.add(i)
            wake.set()

    finished: set[int] = set()
    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        while True:
            if not pending:
                if len(finished) == len(tasks):
                    return
                wake.clear()
                await wake.wait()
                continue
            i = next(iter(pending))
            item = pending.pop(i)
            if isinstance(item, _Failed):
                raise item.exc
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def stream_safe_length(text: str, stop: list[str], finished: bool) -> int:
    """How much of ``text`` may be sent: while a sequence runs, the last ``len(stop) - 1``
    characters could still become a stop string and be cut from the final text."""
    if finished or not stop:
        return len(text)
    return max(0, len(text) - (max(len(s) for s in stop) - 1))
