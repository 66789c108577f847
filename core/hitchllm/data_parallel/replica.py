"""One data-parallel replica: a process that runs a whole engine and serves the server's
requests over a pipe.

The engine steps in an ``AsyncLLMEngine`` thread, exactly as in a one-engine server; this
process's asyncio loop turns pipe messages into ``generate`` calls (one task per request)
and sends their outputs back as deltas (``deltas.py``), all the outputs of one engine step in
one message. A request the
server aborts is cancelled here, which aborts it in the engine. The replica keeps its own
``ServerMetrics``; the server asks for their samples when ``/metrics`` is scraped. When the
pipe closes (the server exited, even if it was killed) the replica shuts down.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from hitchllm.data_parallel.deltas import OutputEncoder
from hitchllm.data_parallel.messages import (
    Abort,
    Call,
    Dead,
    Deliveries,
    Generate,
    Ready,
    Reply,
    StartFailed,
    WireError,
)
from hitchllm.data_parallel.metrics import snapshot
from hitchllm.lora import LoRARequest

if TYPE_CHECKING:
    from hitchllm.config import EngineConfig
    from hitchllm.engine.async_engine import AsyncLLMEngine
    from hitchllm.entrypoints.openai.metrics import ServerMetrics

logger = logging.getLogger(__name__)


@dataclass
class ReplicaSpec:
    """What a replica process is started with."""

    index: int
    config: EngineConfig
    # The model name its metrics are labelled with, and max_loras when LoRA is on.
    metrics_name: str
    max_loras: int | None = None
    # Adapters loaded before it reports ready (``--lora-modules``).
    lora_modules: list[LoRARequest] = field(default_factory=list)


def run_replica(spec: ReplicaSpec, conn: Connection) -> None:
    """The replica process's entry point (its devices and threads are set by the
    environment the server started it with)."""
    # Ctrl-C reaches the whole process group, and so does SIGTERM where a service manager
    # stops the group (systemd); the server drains its requests, then stops its replicas
    # itself (a no-op handler, not SIG_IGN, which processes this one starts would inherit).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: None)
    from hitchllm.engine.async_engine import AsyncLLMEngine
    from hitchllm.engine.llm_engine import LLMEngine
    from hitchllm.entrypoints.openai.metrics import ServerMetrics
    from hitchllm.entrypoints.startup import freeze_startup_objects

    try:
        engine = LLMEngine(spec.config)
        for lora in spec.lora_modules:
            engine.add_lora(lora)
    except BaseException as exc:  # the server reports it and stops the other replicas
        if isinstance(exc, ValueError):  # a bad argument: the server's one line says it all
            conn.send(StartFailed(WireError.of(exc)))
            return
        logger.exception("data-parallel replica %d failed to start", spec.index)
        conn.send(StartFailed(WireError("internal", f"{type(exc).__name__}: {exc}")))
        return
    metrics = ServerMetrics(spec.metrics_name, spec.max_loras)
    server = _ReplicaServer(spec.index, conn, metrics)
    async_engine = AsyncLLMEngine(engine, on_step=metrics.observe, on_dead=server.engine_died)
    freeze_startup_objects()
    try:
        conn.send(Ready(os.getpid(), engine.max_model_len, engine.list_loras(),
                        str(engine.device), _gpu_uuids(engine.device)))
        asyncio.run(server.serve(async_engine))
    finally:
        async_engine.shutdown()


class _ReplicaServer:
    """The replica's message loop."""

    def __init__(self, index: int, conn: Connection, metrics: ServerMetrics) -> None:
        self.index = index
        self.conn = conn
        self.metrics = metrics
        self._send_lock = threading.Lock()
        self._outbox: list[tuple[str, Any]] = []
        self._tasks: dict[str, asyncio.Task[bool]] = {}
        self._calls: set[asyncio.Task[None]] = set()
        self.encoder = OutputEncoder()
        self._engine_dead: str | None = None
        self._loop: asyncio.AbstractEventLoop
        self._inbox: asyncio.Queue[Any]

    def send(self, message: Any) -> None:
        """Send from any thread; a closed pipe (the server is gone) is ignored, the reader
        sees it too and ends the loop."""
        try:
            with self._send_lock:
                self.conn.send(message)
        except OSError:
            pass

    def engine_died(self, exc: BaseException) -> None:
        """``AsyncLLMEngine``'s ``on_dead``, from the engine thread: stop (the server then
        routes nothing more here), after the failed requests and a ``Dead`` saying why."""
        self._engine_dead = f"its engine loop stopped after an unexpected {type(exc).__name__}"
        self._loop.call_soon_threadsafe(self._inbox.put_nowait, None)

    async def serve(self, engine: AsyncLLMEngine) -> None:
        self.engine = engine
        self._loop = loop = asyncio.get_running_loop()
        self._inbox = inbox = asyncio.Queue()

        def read() -> None:
            while True:
                try:
                    message = self.conn.recv()
                except (EOFError, OSError):
                    message = None
                try:
                    loop.call_soon_threadsafe(inbox.put_nowait, message)
                except RuntimeError:  # the loop has closed: the replica stopped serving
                    return
                if message is None:
                    return

        threading.Thread(target=read, name="hitchllm-dp-reader", daemon=True).start()
        try:
            while (message := await inbox.get()) is not None:
                self._dispatch(message)
        finally:
            if self._engine_dead is not None and self._tasks:
                # The engine failed every request; let each tell the server so.
                await asyncio.wait(list(self._tasks.values()), timeout=5)
            for task in self._tasks.values():
                task.cancel()
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)
            if self._outbox:
                self._flush()
            if self._engine_dead is not None:
                self.send(Dead(self._engine_dead))

    def _dispatch(self, message: Any) -> None:
        if isinstance(message, Generate):
            rid = message.request_id
            task = asyncio.create_task(self._generate(message))
            self._tasks[rid] = task
            # A callback, not a finally: a task cancelled before it starts runs no code.
            task.add_done_callback(lambda t: self._ended(rid, t))
        elif isinstance(message, Abort):
            # Cancelling the task aborts the request in the engine (or before it got there).
            task = self._tasks.get(message.request_id)
            if task is not None:
                task.cancel()
        elif isinstance(message, Call):
            task = asyncio.create_task(self._call(message))
            self._calls.add(task)  # the loop keeps only a weak reference
            task.add_done_callback(self._calls.discard)
        else:
            logger.error("replica %d: unknown message %r", self.index, type(message).__name__)

    async def _generate(self, msg: Generate) -> bool:
        """Run one request; True once its last delivery (its finished output, or an error)
        is queued."""
        rid = msg.request_id
        try:
            async for out in self.engine.generate(msg.prompt, msg.params, rid, **msg.kwargs):
                self._deliver(rid, self.encoder.encode(out))
                if out.finished:
                    return True
        except asyncio.CancelledError:
            return False  # aborted by the server, which no longer listens
        except Exception as exc:
            error = WireError.of(exc)
            if error.kind == "internal":
                logger.error("request %s failed", rid, exc_info=exc)
            self.encoder.forget(rid)
            self._deliver(rid, error)
            return True
        return False

    def _ended(self, rid: str, task: asyncio.Task[bool]) -> None:
        """A request's task is done. If the server aborted it, a last None delivery tells
        the server's decoder to forget it."""
        self._tasks.pop(rid, None)
        if task.cancelled() or not task.result():
            self.encoder.forget(rid)
            self._deliver(rid, None)

    def _deliver(self, request_id: str, item: Any) -> None:
        """Queue an output or error; everything queued in one loop iteration (one engine
        step's outputs arrive together) goes in one message."""
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.append((request_id, item))

    def _flush(self) -> None:
        items, self._outbox = self._outbox, []
        if items:
            self.send(Deliveries(items))

    async def _call(self, call: Call) -> None:
        try:
            if call.method == "metrics":
                value: Any = snapshot(self.metrics.registry)
            elif call.method == "add_lora":
                value = await asyncio.to_thread(self.engine.add_lora, *call.args)
            elif call.method == "remove_lora":
                value = await asyncio.to_thread(self.engine.remove_lora, *call.args)
            else:
                raise ValueError(f"unknown call {call.method!r}")
        except Exception as exc:
            self.send(Reply(call.call_id, error=WireError.of(exc)))
        else:
            self.send(Reply(call.call_id, value))


def _gpu_uuids(device: Any) -> list[str]:
    """The UUIDs of the GPUs this process sees (none off CUDA)."""
    if device.type != "cuda":
        return []
    import torch

    return [str(torch.cuda.get_device_properties(i).uuid)
            for i in range(torch.cuda.device_count())]
