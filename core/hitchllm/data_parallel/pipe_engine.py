"""The engine process's side of its pipe to the server (``replica.py`` starts it).

The engine steps in an ``AsyncLLMEngine`` thread, exactly as in an in-process server, but no
asyncio runs here: the engine thread itself turns each step's outputs into deltas
(``deltas.py``) and queues them as one message, which a writer thread sends; the process's
main thread reads the pipe and queues requests, aborts and calls for the engine thread. So
per output the engine process pays for one delta and its pickling, nothing else (no task, no
event-loop wake-up), and HTTP, SSE and JSON run in the server's process, under another GIL.

A request the server aborts ends with a terminal ``None`` delivery; a beam search is a call
answered by its result.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any

from hitchllm.data_parallel.deltas import OutputEncoder
from hitchllm.data_parallel.messages import (
    Abort,
    Call,
    Dead,
    Deliveries,
    Generate,
    Reply,
    WireError,
)
from hitchllm.data_parallel.metrics import snapshot
from hitchllm.engine.async_engine import AsyncLLMEngine
from hitchllm.engine.llm_engine import LLMEngine
from hitchllm.outputs import RequestOutput

if TYPE_CHECKING:
    from hitchllm.entrypoints.openai.metrics import ServerMetrics

logger = logging.getLogger(__name__)


class _PipeStream:
    """One request's ``OutputSink`` on the engine thread: what ``AsyncLLMEngine`` hands it
    (an error, or the final output of an abort) goes to the server as a delivery."""

    __slots__ = ("aborted", "request_id", "server")

    def __init__(self, request_id: str, server: ReplicaServer) -> None:
        self.request_id = request_id
        self.server = server
        self.aborted = False  # the server stopped listening: end with a terminal None

    def put(self, item: Any) -> None:
        server, rid = self.server, self.request_id
        if isinstance(item, BaseException):
            server.encoder.forget(rid)
            error = WireError.of(item)
            if error.kind == "internal":
                logger.error("request %s failed", rid, exc_info=item)
            server.deliver([(rid, error)])
        elif self.aborted:
            server.encoder.forget(rid)
            server.deliver([(rid, None)])
        else:
            server.deliver([(rid, server.encoder.encode(item))])
        if isinstance(item, BaseException) or item.finished:
            server.streams.pop(rid, None)


class _ReplyStream:
    """A beam search's ``OutputSink``: its result (or error) answers the server's call."""

    def __init__(self, call_id: int, server: ReplicaServer) -> None:
        self.call_id = call_id
        self.server = server

    def put(self, item: Any) -> None:
        if isinstance(item, BaseException):
            self.server.send(Reply(self.call_id, error=WireError.of(item)))
        else:
            self.server.send(Reply(self.call_id, item))


class _PipeEngine(AsyncLLMEngine):
    """``AsyncLLMEngine`` whose engine thread sends each step's outputs down the pipe, as
    deltas, in one message."""

    def __init__(self, engine: LLMEngine, server: ReplicaServer, **kwargs: Any) -> None:
        self.server = server
        super().__init__(engine, **kwargs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        streams, encode, items = self._streams, self.server.encoder.encode, []
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del streams[out.request_id]
                self.server.streams.pop(out.request_id, None)
            items.append((out.request_id, encode(out)))
        if items:
            self.server.deliver(items)


class ReplicaServer:
    """The engine process's side of the pipe: the main thread reads it (``serve``), the
    engine thread answers through ``deliver`` and ``send``, a writer thread writes."""

    def __init__(self, index: int, conn: Connection, engine: LLMEngine,
                 metrics: ServerMetrics) -> None:
        """Start the engine thread (and the writer thread) for ``engine``."""
        self.index = index
        self.conn = conn
        self.metrics = metrics
        self.encoder = OutputEncoder()
        # The requests the engine runs, by id (the reader adds, the engine thread removes).
        self.streams: dict[str, _PipeStream] = {}
        # Requests whose logits processors compile, and those of them aborted meanwhile.
        self._compiling: set[str] = set()
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._compile = ThreadPoolExecutor(1, thread_name_prefix="hitchllm-compile")
        self._engine_dead: str | None = None
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name="hitchllm-replica-send",
                                        daemon=True)
        self._writer.start()
        self.engine = _PipeEngine(engine, self, on_step=metrics.observe,
                                  on_dead=self.engine_died)

    # ---- sending (any thread) ----------------------------------------------------------

    def send(self, message: Any) -> None:
        """Queue ``message`` for the server (pickled here, in order, written by the writer
        thread: a server slow to read blocks no one here)."""
        self._outbox.put(bytes(ForkingPickler.dumps(message)))

    def deliver(self, items: list[tuple[str, Any]]) -> None:
        """Queue request outputs (deltas), errors, or terminal Nones as one message."""
        self.send(Deliveries(items))

    def _write(self) -> None:
        while (data := self._outbox.get()) is not None:
            try:
                self.conn.send_bytes(data)
            except (OSError, ValueError):  # the server is gone; the reader sees it too
                return

    def engine_died(self, exc: BaseException) -> None:
        """``AsyncLLMEngine``'s ``on_dead``, from the engine thread after it failed every
        request: tell the server why, then stop serving (it routes nothing more here)."""
        self._engine_dead = f"its engine loop stopped after an unexpected {type(exc).__name__}"
        self.send(Dead(self._engine_dead))

    # ---- reading (the main thread) ------------------------------------------------------

    def serve(self) -> None:
        """Apply the server's messages until its pipe closes, it says stop, or the engine
        loop dies."""
        while self._engine_dead is None:
            try:
                if not self.conn.poll(0.5):
                    continue
                message = self.conn.recv()
            except (EOFError, OSError):
                return
            if message is None:
                return
            try:
                self._dispatch(message)
            except Exception:  # one bad message must not stop the replica
                logger.exception("replica %d: a message could not be handled", self.index)

    def shutdown(self) -> None:
        """Stop the engine thread (and its engine), then the writer once it has sent what
        is queued."""
        self._compile.shutdown(wait=False, cancel_futures=True)
        self.engine.shutdown()
        self._outbox.put(None)
        self._writer.join(10)

    def _dispatch(self, message: Any) -> None:
        if isinstance(message, Generate):
            try:
                processors = self.engine.engine.logits_processors_for(message.params)
            except Exception as exc:  # e.g. a constraint whose plugin is not installed
                self.deliver([(message.request_id, WireError.of(exc))])
                return
            if processors:
                # Grammars compile here, off the engine thread, which then finds them cached.
                with self._lock:
                    self._compiling.add(message.request_id)
                self._compile.submit(self._compile_then_submit, message)
            else:
                self._submit(message)
        elif isinstance(message, Abort):
            rid = message.request_id
            with self._lock:
                if rid in self._compiling:
                    self._cancelled.add(rid)
                    return
            stream = self.streams.get(rid)
            if stream is not None:
                stream.aborted = True
                self.engine.abort(rid)
        elif isinstance(message, Call):
            self._call(message)
        else:
            logger.error("replica %d: unknown message %r", self.index, type(message).__name__)

    def _submit(self, msg: Generate) -> None:
        stream = self.streams[msg.request_id] = _PipeStream(msg.request_id, self)
        self.engine.submit(msg.prompt, msg.params, msg.request_id, stream, **msg.kwargs)

    def _compile_then_submit(self, msg: Generate) -> None:
        failed: Exception | None = None
        try:
            self.engine.engine.compile_logits_processors(msg.params)
        except Exception as exc:  # a grammar that cannot compile fails its request alone
            failed = exc
        with self._lock:
            self._compiling.discard(msg.request_id)
            if msg.request_id in self._cancelled:
                self._cancelled.discard(msg.request_id)
                self.deliver([(msg.request_id, None)])
            elif failed is not None:
                self.deliver([(msg.request_id, WireError.of(failed))])
            else:
                self._submit(msg)

    def _call(self, call: Call) -> None:
        """Answer a call: metrics at once, beam search on the engine thread, LoRA changes in
        a thread of their own (loading an adapter may take a while)."""
        if call.method == "metrics":
            self.send(Reply(call.call_id, snapshot(self.metrics.registry)))
        elif call.method == "beam_search":
            self.engine.submit_beam_search(*call.args, _ReplyStream(call.call_id, self))
        elif call.method in ("add_lora", "remove_lora"):
            threading.Thread(target=self._run_call, args=(call,), daemon=True,
                             name="hitchllm-replica-call").start()
        else:
            self.send(Reply(call.call_id, error=WireError.of(
                ValueError(f"unknown call {call.method!r}"))))

    def _run_call(self, call: Call) -> None:
        try:
            value = getattr(self.engine, call.method)(*call.args)
        except Exception as exc:
            self.send(Reply(call.call_id, error=WireError.of(exc)))
        else:
            self.send(Reply(call.call_id, value))
