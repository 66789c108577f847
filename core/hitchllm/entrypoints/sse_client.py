"""A minimal HTTP/1.1 client for streamed (server-sent events) responses, on asyncio streams.

``hitchllm bench serve`` loads a server with hundreds of concurrent streams; a client library
that builds a typed object per chunk spends as much CPU per token as the server does, and on a
machine the two share it slows the server it measures. This client needs nothing beyond the
standard library (so the benchmark runs wherever the server does) and does little per chunk:
it splits the chunked body into SSE events and hands back each event's data, timestamped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit


class HTTPStatusError(RuntimeError):
    """The server answered with a status other than 200."""


def split_url(url: str) -> tuple[str, int, str]:
    """``(host, port, path)`` of an ``http://`` URL (ValueError for any other scheme)."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"--base-url must be an http:// URL with a host, got {url!r}")
    return parts.hostname, parts.port or 80, parts.path.rstrip("/")


async def stream_events(
    host: str, port: int, path: str, body: bytes, headers: dict[str, str] | None = None,
) -> AsyncIterator[tuple[float, bytes]]:
    """POST ``body`` (JSON) to ``path`` and yield ``(perf_counter time, data)`` for every SSE
    event of the response, as it arrives. Raises ``HTTPStatusError`` for a status other than
    200 (with the response body in the message)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        head = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}",
                "Content-Type: application/json", f"Content-Length: {len(body)}",
                "Accept: text/event-stream", "Connection: close"]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        await writer.drain()
        status_line = await reader.readline()
        status = int(status_line.split()[1])
        response_headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            response_headers[name.strip().lower()] = value.strip()
        chunked = response_headers.get("transfer-encoding", "").lower() == "chunked"
        if status != 200:
            raise HTTPStatusError(f"HTTP {status}: {(await _read_all(reader, chunked)).decode()}")
        pending = b""
        async for data in _body_pieces(reader, chunked):
            pending += data
            *events, pending = pending.split(b"\n\n")
            now = time.perf_counter()
            for event in events:
                for line in event.split(b"\n"):
                    if line.startswith(b"data: "):
                        yield now, line[6:]
    finally:
        writer.close()


async def _body_pieces(reader: asyncio.StreamReader, chunked: bool) -> AsyncIterator[bytes]:
    if not chunked:  # read to the end of the connection
        while data := await reader.read(65536):
            yield data
        return
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            return
        data = await reader.readexactly(size + 2)
        yield data[:-2]


async def _read_all(reader: asyncio.StreamReader, chunked: bool) -> bytes:
    return b"".join([piece async for piece in _body_pieces(reader, chunked)])
