"""The server's side of one replica process: its pipe, the requests it runs and the calls
waiting for its answers (used by ``DataParallelEngine``)."""

from __future__ import annotations

import concurrent.futures
import multiprocessing.process
import queue
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

from hitchllm.data_parallel.deltas import OutputDecoder
from hitchllm.data_parallel.messages import Ready, StartFailed, WireError
from hitchllm.data_parallel.metrics import Family
from hitchllm.engine.async_engine import EngineDeadError, RequestFailedError, RequestStream


class ReplicaHandle:
    """The server's side of one replica process."""

    def __init__(self, index: int, process: multiprocessing.process.BaseProcess,
                 conn: Connection) -> None:
        self.index = index
        self.process = process
        self.conn = conn
        self.streams: dict[str, RequestStream] = {}
        self.calls: dict[int, concurrent.futures.Future[Any]] = {}
        self.dead_reason: str | None = None
        self.last_metrics: list[Family] = []
        self.decoder = OutputDecoder()  # used by the reader thread only
        # Pickled messages on their way to the replica; None stops the writer thread.
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._broken = False
        threading.Thread(target=self._write, daemon=True,
                         name=f"hitchllm-dp-send-{index}").start()

    def send(self, message: Any) -> bool:
        """Queue ``message`` for the replica; False when the replica is gone. It is pickled
        here (what cannot be pickled raises here) and written by a thread of its own, so that
        a replica that stops reading (hung) and fills its pipe blocks no caller, least of
        all the server's event loop."""
        if self.dead_reason is not None or self._broken:
            return False
        self._outbox.put(bytes(ForkingPickler.dumps(message)))
        return True

    def _write(self) -> None:
        while (data := self._outbox.get()) is not None:
            try:
                self.conn.send_bytes(data)
            except (OSError, ValueError):  # the pipe is closed: the replica has exited
                self._broken = True
                return

    def close(self) -> None:
        """Stop the writer thread and close the pipe (once the process has exited)."""
        self._outbox.put(None)
        self.conn.close()

    def wait_ready(self, deadline: float | None) -> Ready:
        """Block until the replica has built its engine; RuntimeError (ValueError for a bad
        argument) if it could not, exited, or is not ready by ``deadline`` (monotonic)."""
        while not self.conn.poll(1.0):
            if not self.process.is_alive():
                raise RuntimeError(f"data-parallel replica {self.index} exited with code "
                                   f"{self.process.exitcode} while starting (see its log)")
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(f"data-parallel replica {self.index} did not start in time")
        try:
            message = self.conn.recv()
        except (EOFError, OSError) as exc:
            raise RuntimeError(f"data-parallel replica {self.index} exited while starting "
                               "(see its log)") from exc
        if isinstance(message, StartFailed):
            error = message.error
            kind = ValueError if error.kind == "invalid" else RuntimeError
            raise kind(f"data-parallel replica {self.index} failed to start: {error.message}")
        assert isinstance(message, Ready), message
        return message


def as_exception(error: WireError, replica: int) -> Exception:
    if error.kind == "invalid":
        return ValueError(error.message)
    if error.kind == "type":
        return TypeError(error.message)
    if error.kind == "dead":
        return EngineDeadError(f"data-parallel replica {replica}: {error.message}")
    if error.kind == "failed":
        return RequestFailedError(error.message)
    return RequestFailedError(f"data-parallel replica {replica} failed the request "
                              f"({error.message})")
